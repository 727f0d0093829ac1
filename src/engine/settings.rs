//! Engine settings: the checks on what the caller gave, and the block size and queue depth filled in
//! from the drive's plan (`machine::plan_io`) where the caller left them at 0.

use super::EngineConfig;
use crate::error::{Error, Result};

/// Rejects unusable settings the caller gave, naming the setting and the value (a block size or queue
/// depth of 0 is "pick for the drive", filled by `pick` once the swap files are open).
pub(super) fn validate(cfg: &mut EngineConfig) -> Result<()> {
    let bad = |m: String| Err(Error::InvalidArgument(m));
    if cfg.paths.is_empty() {
        return bad("at least one swap path is required".into());
    }
    let bs = cfg.block_size;
    if bs != 0 && (!bs.is_power_of_two() || !(4096..=64 << 20).contains(&bs)) {
        return bad(format!(
            "block_size must be a power of two from 4096 to 64 MiB, got {bs}"
        ));
    }
    if cfg.queue_depth > 4096 {
        return bad(format!(
            "queue_depth must be from 1 to 4096, got {}",
            cfg.queue_depth
        ));
    }
    Ok(())
}

/// Fills a block size or queue depth left at 0 from `plan`; returns the reason for each value.
pub(super) fn pick(cfg: &mut EngineConfig, plan: &crate::machine::IoPlan) -> (String, String) {
    let why_block = if cfg.block_size == 0 {
        cfg.block_size = plan.block_size;
        plan.why_block.clone()
    } else {
        format!("{} KiB: given", cfg.block_size >> 10)
    };
    let why_depth = if cfg.queue_depth != 0 {
        format!("{}: given", cfg.queue_depth)
    } else if plan.block_size == cfg.block_size {
        cfg.queue_depth = plan.queue_depth;
        plan.why_depth.clone()
    } else {
        // A given block size: the same bytes in flight as the plan's.
        cfg.queue_depth = (plan.block_size * plan.queue_depth / cfg.block_size)
            .clamp(crate::machine::MIN_AUTO_DEPTH, 4096);
        format!(
            "{}: {} MiB in flight, as picked for this drive",
            cfg.queue_depth,
            (plan.block_size * plan.queue_depth) >> 20
        )
    };
    (why_block, why_depth)
}

/// The checks that need the block size and queue depth settled.
pub(super) fn finish_validation(cfg: &mut EngineConfig) -> Result<()> {
    let bad = |m: String| Err(Error::InvalidArgument(m));
    let bs = cfg.block_size;
    if cfg.threads == 0 {
        cfg.threads = cfg.paths.len().max(2);
    }
    cfg.threads = cfg.threads.min(cfg.queue_depth);
    if cfg.threads > 256 {
        return bad(format!("threads must be at most 256, got {}", cfg.threads));
    }
    if let Some(b) = cfg.pinned_memory_budget {
        if b < cfg.threads * bs {
            return bad(format!(
                "pinned_memory_budget {b} bytes is too small: the engine needs at least threads × block_size \
                 = {} × {bs} = {} bytes of bounce buffers; raise the budget or lower block_size/threads",
                cfg.threads,
                cfg.threads * bs
            ));
        }
    }
    Ok(())
}
