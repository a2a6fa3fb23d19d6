//! A short soak on the simulated engine (`scripts/soak` runs the long one on the default
//! model): streams in flight while worker B is killed and started again, every stream
//! identical to an uninterrupted run, worker A and the coordinator alive throughout.

use std::time::Duration;

use baton_integration_tests::soak::{self, SoakOptions};
use baton_integration_tests::{Cluster, ClusterOptions};

#[test]
fn a_short_simulated_soak_passes() {
    let Some(mut cluster) = Cluster::start(ClusterOptions::simulated(2).step_ms(20)) else {
        return;
    };
    let options = SoakOptions {
        duration: Duration::from_secs(15),
        kill_every: Duration::from_secs(8),
        restart_after: Duration::from_secs(2),
        concurrency: 4,
        max_tokens: 16,
    };
    let report = soak::run(&mut cluster, &options);
    println!("{}{}", report.samples_table(), report.line());
    assert!(
        report.ok() && report.kills == 1,
        "{}\n{}\n{}\n{}",
        report.line(),
        report.problems.join("\n"),
        report.failures.join("\n"),
        cluster.logs()
    );
    assert!(report.samples.len() >= 2, "memory sampled at start and end");
}
