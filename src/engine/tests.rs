//! The same bodies run against every backend and access mode on real files in a temp directory.

use super::*;

fn engines(dir: &std::path::Path) -> Vec<(String, Engine)> {
    let mut v = Vec::new();
    for backend in [Backend::IoUring, Backend::Psync] {
        if backend == Backend::IoUring && uring::probe().is_err() {
            eprintln!("skipping io_uring: io_uring_setup refused on this machine");
            continue;
        }
        for direct in [DirectMode::Auto, DirectMode::Off] {
            let cfg = EngineConfig {
                paths: vec![dir.to_path_buf()],
                block_size: 64 << 10,
                queue_depth: 8,
                backend,
                direct,
                checksum: true,
                ..Default::default()
            };
            v.push((format!("{backend:?}/{direct:?}"), Engine::new(cfg).unwrap()));
        }
    }
    v
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn roundtrip_vec(e: &Engine, key: &str, data: &[u8]) -> Result<Vec<u8>> {
    // SAFETY: `data` and `out` outlive the waits below.
    unsafe {
        e.write(key, data.as_ptr(), data.len())?.wait()?;
        let mut out = vec![0u8; data.len()];
        e.read(key, out.as_mut_ptr(), out.len())?.wait()?;
        Ok(out)
    }
}

#[test]
fn round_trips_odd_sizes_from_plain_and_engine_memory() {
    let d = tempfile::tempdir().unwrap();
    for (name, e) in engines(d.path()) {
        for (i, n) in [1usize, 4095, 4097, (3 << 20) + 7, 0]
            .into_iter()
            .enumerate()
        {
            let data = pattern(n, i as u8);
            assert_eq!(
                roundtrip_vec(&e, &format!("k{i}"), &data).unwrap(),
                data,
                "{name} n={n}"
            );
            let buf = e.alloc(n).unwrap();
            let back = e.alloc(n).unwrap();
            // SAFETY: both buffers hold at least n bytes and live until the end of this iteration.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), buf.as_ptr(), n);
                e.write("b", buf.as_ptr(), n).unwrap().wait().unwrap();
                e.read("b", back.as_ptr(), n).unwrap().wait().unwrap();
                assert_eq!(
                    &back.as_slice()[..n],
                    &data[..],
                    "{name} engine buffer n={n}"
                );
            }
        }
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            0,
            "{name} left a file"
        );
    }
}

#[test]
fn stripes_over_several_paths() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let e = Engine::new(EngineConfig {
        paths: dirs.iter().map(|d| d.path().to_path_buf()).collect(),
        block_size: 4096,
        ..Default::default()
    })
    .unwrap();
    let data = pattern(10 * 4096 + 5, 7);
    assert_eq!(roundtrip_vec(&e, "s", &data).unwrap(), data);
    assert!(
        e.store.files.iter().all(|f| lock(&f.alloc).end() > 0),
        "every path holds a share"
    );
}

#[test]
fn short_transfers_are_continued() {
    let d = tempfile::tempdir().unwrap();
    for (name, e) in engines(d.path()) {
        // Under O_DIRECT a real short transfer still ends on an aligned boundary.
        let short = if e.resolved().direct { 4096 } else { 1000 };
        e.faults().add(Op::Write, Fault::Short(short), 1, 3);
        e.faults().add(Op::Read, Fault::Short(short), 0, 3);
        let data = pattern(4 * 65536 + 8192, 3); // every block longer than `short`
        assert_eq!(roundtrip_vec(&e, "k", &data).unwrap(), data, "{name}");
        assert_eq!(e.stats().short_transfers, 6, "{name}: {:?}", e.stats());
    }
}

#[test]
fn errno_reaches_the_waiter_and_engine_stays_usable() {
    let d = tempfile::tempdir().unwrap();
    for (name, e) in engines(d.path()) {
        e.faults().add(Op::Write, Fault::Errno(libc::EIO), 0, 1);
        let data = pattern(100_000, 1);
        match roundtrip_vec(&e, "bad", &data) {
            Err(Error::Io {
                op,
                errno,
                path,
                length,
                key,
                ..
            }) => {
                assert_eq!((op, errno), (Op::Write, libc::EIO), "{name}");
                assert_eq!(path, d.path());
                assert!(length > 0);
                assert_eq!(key.as_deref(), Some("bad"));
            }
            other => panic!("{name}: expected EIO, got {other:?}"),
        }
        let mut out = vec![0u8; data.len()];
        // SAFETY: out outlives the call; the read fails before any I/O is issued.
        let err = unsafe { e.read("bad", out.as_mut_ptr(), out.len()) }.err();
        assert!(
            matches!(err, Some(Error::Poisoned { .. })),
            "{name}: {err:?}"
        );
        e.faults().add(Op::Read, Fault::Errno(libc::EIO), 0, 1);
        assert!(matches!(
            roundtrip_vec(&e, "ok", &data),
            Err(Error::Io { op: Op::Read, .. })
        ));
        assert_eq!(
            roundtrip_vec(&e, "ok", &data).unwrap(),
            data,
            "{name}: usable after errors"
        );
        e.free("bad").unwrap();
    }
}

#[test]
fn corruption_is_caught_by_checksums() {
    let d = tempfile::tempdir().unwrap();
    for (name, e) in engines(d.path()) {
        let data = pattern(3 * 65536, 9);
        e.faults().add(Op::Read, Fault::Corrupt, 1, 1);
        match roundtrip_vec(&e, "c", &data) {
            Err(Error::Checksum { key, block, .. }) => {
                assert_eq!(key, "c");
                assert!(block < 3);
            }
            other => panic!("{name}: expected a checksum error, got {other:?}"),
        }
    }
}

#[test]
fn unknown_keys_wrong_sizes_and_closed_engines_are_errors() {
    let d = tempfile::tempdir().unwrap();
    for (name, e) in engines(d.path()) {
        let mut out = vec![0u8; 10];
        // SAFETY: out outlives every call; none issues I/O.
        unsafe {
            assert!(matches!(
                e.read("nope", out.as_mut_ptr(), 10),
                Err(Error::UnknownKey(_))
            ));
            roundtrip_vec(&e, "k", &[1, 2, 3]).unwrap();
            assert!(
                matches!(e.read("k", out.as_mut_ptr(), 10), Err(Error::Memory(_))),
                "{name}"
            );
        }
        assert!(matches!(e.free("nope"), Err(Error::UnknownKey(_))));
        e.free("k").unwrap();
        e.close();
        assert!(matches!(e.free("k"), Err(Error::Closed)));
        assert!(matches!(roundtrip_vec(&e, "k", &[1]), Err(Error::Closed)));
    }
}

#[test]
fn freed_space_is_reused_and_overwrites_replace() {
    let d = tempfile::tempdir().unwrap();
    for (name, e) in engines(d.path()) {
        for round in 0..20u8 {
            let data = pattern(300_000, round);
            assert_eq!(roundtrip_vec(&e, "k", &data).unwrap(), data, "{name}");
        }
        let used = e.stats().reserved_bytes;
        assert!(
            used <= 2 * 300_000 + (1 << 20),
            "{name}: overwrites leaked space: {used}"
        );
        e.free("k").unwrap();
        assert_eq!(e.stats().reserved_bytes, 0, "{name}");
    }
}

#[test]
fn many_threads_many_keys() {
    let d = tempfile::tempdir().unwrap();
    for (name, e) in engines(d.path()) {
        std::thread::scope(|s| {
            for t in 0..8u8 {
                let (e, name) = (&e, &name);
                s.spawn(move || {
                    for k in 0..20u8 {
                        let data = pattern(1000 + 7919 * k as usize, t ^ k);
                        let key = format!("{t}/{k}");
                        assert_eq!(roundtrip_vec(e, &key, &data).unwrap(), data, "{name} {key}");
                    }
                });
            }
        });
        assert_eq!(e.stats().keys, 160);
    }
}

#[test]
fn bad_settings_name_the_setting() {
    let d = tempfile::tempdir().unwrap();
    let cfg = |f: &dyn Fn(&mut EngineConfig)| {
        let mut c = EngineConfig {
            paths: vec![d.path().to_path_buf()],
            ..Default::default()
        };
        f(&mut c);
        Engine::new(c)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(cfg(&|c| c.block_size = 5000).contains("block_size"));
    assert!(cfg(&|c| c.queue_depth = 5000).contains("queue_depth"));
    assert!(cfg(&|c| c.pinned_memory_budget = Some(4096)).contains("pinned_memory_budget"));
    assert!(cfg(&|c| c.paths = vec![d.path().join("missing")]).contains("No such file"));
}

#[test]
fn default_settings_are_picked_and_explained() {
    let d = tempfile::tempdir().unwrap();
    let e = Engine::new(EngineConfig {
        paths: vec![d.path().to_path_buf()],
        ..Default::default()
    })
    .unwrap();
    let r = e.resolved();
    assert!(r.block_size.is_power_of_two());
    assert!(r.queue_depth >= crate::machine::MIN_AUTO_DEPTH);
    let want = crate::machine::plan_io(r.limits.as_ref(), crate::buffer::buffer_page());
    assert_eq!(
        (r.block_size, r.queue_depth),
        (want.block_size, want.queue_depth)
    );
    assert_eq!(
        (&r.why_block, &r.why_depth),
        (&want.why_block, &want.why_depth)
    );
    // A given block size keeps the picked bytes in flight.
    let e = Engine::new(EngineConfig {
        paths: vec![d.path().to_path_buf()],
        block_size: want.block_size / 2,
        ..Default::default()
    })
    .unwrap();
    let r = e.resolved();
    assert_eq!(r.why_block, format!("{} KiB: given", want.block_size >> 11));
    assert_eq!(
        r.queue_depth,
        (want.queue_depth * 2).clamp(crate::machine::MIN_AUTO_DEPTH, 4096)
    );
}
