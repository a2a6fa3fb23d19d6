/*
 * membw: sustained memory READ bandwidth (sum reduction over a large buffer).
 *
 * This is the roofline for single-stream decode: every generated token has to
 * stream all weight bytes from DRAM once, so tok/s <= GB_s / weight_bytes.
 *
 * Build: gcc -O3 -march=native -fopenmp -o membw membw.c   (see scripts/membw)
 * Usage: membw [--size-mib N] [--reps N] [--threads 1,2,...]
 * Output (one line per thread count, stable, machine-readable):
 *   membw read threads=1 GB_s=12.34 best_ms=87.0 size_mib=1024 reps=10
 * GB = 1e9 bytes. "best" = fastest of the reps (least disturbed by noise).
 */
#define _POSIX_C_SOURCE 200809L
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Integer adds are associative, so -O3 vectorises this into wide loads and
 * several independent accumulators without needing -ffast-math. */
__attribute__((noinline)) static uint64_t sum_range(const uint64_t *restrict p, size_t n) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += p[i + 0];
        s1 += p[i + 1];
        s2 += p[i + 2];
        s3 += p[i + 3];
    }
    for (; i < n; i++) s0 += p[i];
    return s0 + s1 + s2 + s3;
}

/* Each thread reads one contiguous slice (same static split as first touch). */
static uint64_t sum_parallel(const uint64_t *p, size_t n, int threads) {
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int t = omp_get_thread_num();
        int nt = omp_get_num_threads();
        size_t chunk = n / (size_t)nt;
        size_t lo = (size_t)t * chunk;
        size_t hi = (t == nt - 1) ? n : lo + chunk;
        total += sum_range(p + lo, hi - lo);
    }
    return total;
}

static void usage(const char *argv0) {
    fprintf(stderr, "usage: %s [--size-mib N (1024)] [--reps N (10)] [--threads LIST (1,<nproc>)]\n",
            argv0);
}

int main(int argc, char **argv) {
    size_t size_mib = 1024;
    int reps = 10;
    int tlist[64];
    int nt = 0;

    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--size-mib") && i + 1 < argc) {
            size_mib = (size_t)strtoull(argv[++i], NULL, 10);
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            char *s = argv[++i];
            char *tok = strtok(s, ",");
            while (tok && nt < 64) {
                int v = atoi(tok);
                if (v > 0) tlist[nt++] = v;
                tok = strtok(NULL, ",");
            }
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(argv[0]);
            return 0;
        } else {
            usage(argv[0]);
            return 2;
        }
    }
    if (size_mib == 0 || reps <= 0) {
        usage(argv[0]);
        return 2;
    }
    int nproc = omp_get_num_procs();
    if (nt == 0) {
        tlist[nt++] = 1;
        if (nproc > 1) tlist[nt++] = nproc;
    }
    int maxt = 1;
    for (int i = 0; i < nt; i++)
        if (tlist[i] > maxt) maxt = tlist[i];

    size_t bytes = size_mib << 20;
    size_t n = bytes / sizeof(uint64_t);
    uint64_t *buf = NULL;
    if (posix_memalign((void **)&buf, 4096, bytes) != 0 || !buf) {
        fprintf(stderr, "membw: cannot allocate %zu MiB\n", size_mib);
        return 1;
    }

    /* First touch in parallel so pages are actually backed (and NUMA-local). */
#pragma omp parallel num_threads(maxt)
    {
        int t = omp_get_thread_num();
        int k = omp_get_num_threads();
        size_t chunk = n / (size_t)k;
        size_t lo = (size_t)t * chunk;
        size_t hi = (t == k - 1) ? n : lo + chunk;
        for (size_t i = lo; i < hi; i++) buf[i] = i * 0x9E3779B97F4A7C15ULL;
    }
    uint64_t expect = 0;
    for (size_t i = 0; i < n; i++) expect += i * 0x9E3779B97F4A7C15ULL;

    for (int ti = 0; ti < nt; ti++) {
        int threads = tlist[ti];
        (void)sum_parallel(buf, n, threads); /* warm-up: thread pool, TLB */
        double best = 1e30;
        for (int r = 0; r < reps; r++) {
            __asm__ volatile("" ::: "memory");
            double t0 = now_s();
            uint64_t s = sum_parallel(buf, n, threads);
            double dt = now_s() - t0;
            __asm__ volatile("" ::: "memory");
            if (s != expect) {
                fprintf(stderr, "membw: checksum mismatch\n");
                return 1;
            }
            if (dt < best) best = dt;
        }
        printf("membw read threads=%d GB_s=%.2f best_ms=%.1f size_mib=%zu reps=%d\n", threads,
               (double)bytes / best / 1e9, best * 1e3, size_mib, reps);
        fflush(stdout);
    }
    free(buf);
    return 0;
}
