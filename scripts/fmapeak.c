/*
 * fmapeak: this machine's f32 multiply-add throughput, the bound of an f32 prompt
 * (prefill): 24 independent chains of fused multiply-adds on the widest vectors
 * -march=native gives, on each of N threads at once.
 *
 * Build: gcc -O2 -march=native -ffp-contract=fast -fopenmp (see scripts/fmapeak)
 * Usage: fmapeak [--threads 1,2,...] [--reps N]
 * Output (one line per thread count):
 *   fmapeak threads=2 G_fma_s=161.3 gflops=322.6 lanes=16 reps=3
 * "G_fma_s": 1e9 single-precision multiply-adds a second, all threads, best of reps.
 */
#define _POSIX_C_SOURCE 200809L
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vec __attribute__((vector_size(4 * LANES)));
#define CHAINS 24

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* a = a·x + y on CHAINS independent accumulators; the result is returned so the
 * loop is not removed. */
__attribute__((noinline)) static float chains(long iters, float seed) {
    vec a[CHAINS];
    vec x, y;
    for (int l = 0; l < LANES; l++) {
        x[l] = 1.0f - 1e-7f;
        y[l] = 1e-7f * seed;
    }
    for (int i = 0; i < CHAINS; i++)
        for (int l = 0; l < LANES; l++) a[i][l] = (float)(i + l) + seed;
    for (long k = 0; k < iters; k++) {
#pragma GCC unroll 24
        for (int i = 0; i < CHAINS; i++) a[i] = a[i] * x + y;
    }
    float s = 0;
    for (int i = 0; i < CHAINS; i++)
        for (int l = 0; l < LANES; l++) s += a[i][l];
    return s;
}

int main(int argc, char **argv) {
    const char *threads = NULL;
    int reps = 3;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--threads")) threads = argv[i + 1];
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else { fprintf(stderr, "fmapeak: unknown argument %s\n", argv[i]); return 2; }
    }
    char all[64];
    if (!threads) {
        snprintf(all, sizeof all, "1,%d", omp_get_num_procs());
        threads = all;
    }
    const long iters = 20000000;
    char *list = strdup(threads);
    for (char *t = strtok(list, ","); t; t = strtok(NULL, ",")) {
        int n = atoi(t);
        if (n < 1) continue;
        double best = 1e30;
        float sink = 0;
        for (int r = 0; r < reps; r++) {
            double t0 = now_s();
#pragma omp parallel num_threads(n) reduction(+ : sink)
            sink += chains(iters, (float)omp_get_thread_num());
            double dt = now_s() - t0;
            if (dt < best) best = dt;
        }
        double fma = (double)n * iters * CHAINS * LANES;
        printf("fmapeak threads=%d G_fma_s=%.1f gflops=%.1f lanes=%d reps=%d%s\n", n,
               fma / best / 1e9, 2 * fma / best / 1e9, LANES, reps, sink == 12345.0f ? " " : "");
    }
    free(list);
    return 0;
}
