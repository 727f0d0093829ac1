//! Criterion benches of the engine alone (no Python): backend × block size × queue depth, writing and
//! reading a fixed 64 MiB payload from an engine buffer (zero-copy) and from ordinary heap memory
//! (bounce copies), next to the bare io_uring loop of `baseline.rs` on the same directory.
//!
//! The directory is `$ZSWAP_BENCH_DIR` or a temp dir on the local disk. Throughput is reported in bytes,
//! so Criterion prints GB/s beside each figure.

use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use zswap::{Backend, Engine, EngineConfig};

/// 64 MiB: large enough to stream (64 blocks of 1 MiB), small enough for many samples per config.
const PAYLOAD: usize = 64 << 20;

fn bench_dir() -> (Option<tempfile::TempDir>, PathBuf) {
    match std::env::var_os("ZSWAP_BENCH_DIR") {
        Some(d) => (None, PathBuf::from(d)),
        None => {
            let t = tempfile::tempdir_in("/var/tmp")
                .or_else(|_| tempfile::tempdir())
                .expect("temp dir");
            let p = t.path().to_path_buf();
            (Some(t), p)
        }
    }
}

fn engine_benches(c: &mut Criterion) {
    let (_keep, dir) = bench_dir();
    let mut g = c.benchmark_group("swap");
    g.throughput(Throughput::Bytes(PAYLOAD as u64));
    g.sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));

    let heap = vec![7u8; PAYLOAD];
    let mut heap_out = vec![0u8; PAYLOAD];
    // (0, 0) first: the engine's own pick for the drive (`machine::plan_io`), named by what it picked.
    let mut settings = vec![(0, 0)];
    for block_size in [256 << 10, 1 << 20, 4 << 20] {
        settings.extend([4, 16, 64].map(|queue_depth| (block_size, queue_depth)));
    }
    for backend in [Backend::IoUring, Backend::Psync] {
        for &(block_size, queue_depth) in &settings {
            let cfg = EngineConfig {
                paths: vec![dir.clone()],
                block_size,
                queue_depth,
                backend,
                ..Default::default()
            };
            let Ok(e) = Engine::new(cfg) else { continue };
            let buf = e.alloc(PAYLOAD).expect("engine buffer");
            let r = e.resolved();
            let picked = if block_size == 0 { "auto/" } else { "" };
            let id = format!(
                "{backend:?}/{picked}bs={}K/qd={}",
                r.block_size >> 10,
                r.queue_depth
            );
            // SAFETY (all four): the source and destination live until each call's wait returns.
            g.bench_function(BenchmarkId::new("write-engine-buffer", &id), |b| {
                b.iter(|| unsafe { e.write("k", buf.as_ptr(), PAYLOAD).unwrap().wait().unwrap() })
            });
            g.bench_function(BenchmarkId::new("read-engine-buffer", &id), |b| {
                b.iter(|| unsafe { e.read("k", buf.as_ptr(), PAYLOAD).unwrap().wait().unwrap() })
            });
            g.bench_function(BenchmarkId::new("write-heap", &id), |b| {
                b.iter(|| unsafe {
                    e.write("h", heap.as_ptr(), PAYLOAD)
                        .unwrap()
                        .wait()
                        .unwrap()
                })
            });
            g.bench_function(BenchmarkId::new("read-heap", &id), |b| {
                b.iter(|| unsafe {
                    e.read("h", heap_out.as_mut_ptr(), PAYLOAD)
                        .unwrap()
                        .wait()
                        .unwrap()
                })
            });
        }
    }
    for block_size in [256 << 10, 1 << 20, 4 << 20] {
        for queue_depth in [4, 16, 64] {
            let id = format!("bs={}K/qd={queue_depth}", block_size >> 10);
            // The raw loop times its own passes; Criterion's iter_custom reports them as throughput.
            g.bench_function(BenchmarkId::new("raw-io_uring-write+read", &id), |b| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| {
                            let (w, r) = zswap::baseline::raw_io_uring(
                                &dir,
                                PAYLOAD as u64 / 2,
                                block_size,
                                queue_depth,
                            )
                            .expect("raw baseline");
                            w + r
                        })
                        .sum()
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, engine_benches);
criterion_main!(benches);
