//! The PCIe share balanced at run time (live knob `pcie_auto`): each split hybrid MoE layer of a decode token
//! asks, when the CPU pool has finished its rows of the layer's misses, whether the GPU has finished its rows
//! (the PCIe uploads and the split experts' kernels). A layer where the GPU is still busy votes for a smaller
//! share, one where it is done for a larger one; after a token's worth of layers the share moves one step toward
//! the majority (held when neither side has 60% of the votes). The step halves when the direction turns and
//! doubles from the third move in one direction on, between one row step of the split and 1/8 of the expert, so
//! the share settles where the link side and the CPU side end together and follows when that point moves.

/// Share of the votes a side needs before the share moves.
const MAJORITY: f32 = 0.6;
/// Largest step of the share per token.
const MAX_STEP: f32 = 0.125;

/// State of the balanced PCIe share. Shares are fractions of a miss's intermediate rows in [0, 1].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PcieBalance {
    /// The share used now; `None` until the first split layer sets the start.
    share: Option<f32>,
    /// Current step (fraction of the rows).
    step: f32,
    /// Direction of the last move: +1 up, −1 down, 0 none yet.
    last: i8,
    /// Moves in a row in that direction.
    run: u32,
    /// Layers of the current count where the GPU finished after the CPU.
    gpu_late: u32,
    /// Layers where the GPU had finished first.
    cpu_late: u32,
}

impl Default for PcieBalance {
    fn default() -> Self {
        PcieBalance { share: None, step: 1.0 / 16.0, last: 0, run: 0, gpu_late: 0, cpu_late: 0 }
    }
}

impl PcieBalance {
    /// The share to split this layer's misses with: the balanced one, or `start` before any was set (then it
    /// becomes the balanced one). `min_step`: one row step of the split as a fraction of the rows
    /// (`split_rows`' step / n_ff_exp); the share stays within [min_step, 1 − min_step] so that every miss is
    /// split (a share of 0 or 1 would leave one side idle and nothing to measure).
    pub fn share(&mut self, start: f32, min_step: f32) -> f32 {
        let lo = min_step.clamp(0.0, 0.5);
        if self.share.is_none() {
            // a step below one row step would not move the split
            self.step = self.step.clamp(lo.max(1e-4), MAX_STEP.max(lo));
        }
        *self.share.get_or_insert(start.clamp(lo, 1.0 - lo))
    }

    /// The balanced share, once set.
    pub fn current(&self) -> Option<f32> {
        self.share
    }

    /// One split layer's vote: `gpu_done` = the GPU's part of the layer had finished when the CPU's had.
    /// After `window` votes (a token's MoE layers) the share moves (see the module doc) and the count restarts.
    pub fn vote(&mut self, gpu_done: bool, window: u32, min_step: f32) {
        if gpu_done {
            self.cpu_late += 1;
        } else {
            self.gpu_late += 1;
        }
        let n = self.gpu_late + self.cpu_late;
        if n < window.max(1) {
            return;
        }
        let dir: i8 = if self.cpu_late as f32 >= MAJORITY * n as f32 {
            1
        } else if self.gpu_late as f32 >= MAJORITY * n as f32 {
            -1
        } else {
            0
        };
        self.gpu_late = 0;
        self.cpu_late = 0;
        let lo = min_step.clamp(1e-4, 0.5);
        if dir == 0 {
            return;
        }
        if self.last == dir {
            self.run += 1;
            if self.run >= 3 {
                self.step = (self.step * 2.0).min(MAX_STEP.max(lo));
            }
        } else {
            if self.last == -dir {
                self.step = (self.step / 2.0).max(lo);
            }
            self.run = 1;
        }
        self.last = dir;
        if let Some(s) = &mut self.share {
            *s = (*s + dir as f32 * self.step).clamp(lo, 1.0 - lo);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PcieBalance;

    /// A simulated layer: the CPU's time falls and the link side's time rises with the share; returns whether
    /// the GPU side finished first.
    fn gpu_done(share: f32, cpu_ms_all: f32, link_ms_all: f32) -> bool {
        link_ms_all * share <= cpu_ms_all * (1.0 - share)
    }

    #[test]
    fn the_share_settles_where_both_sides_end_together() {
        // Qwen3-like: CPU 0.28 ms for a whole miss's rows, link 0.23 ms → balance at 0.28 / 0.51 = 0.549
        let step = 64.0 / 768.0;
        for start in [0.1f32, 0.5, 0.9] {
            let mut b = PcieBalance::default();
            for _ in 0..200 {
                let s = b.share(start, step);
                for _ in 0..48 {
                    b.vote(gpu_done(s, 0.28, 0.23), 48, step);
                }
            }
            let s = b.current().unwrap();
            assert!((s - 0.549).abs() <= step, "start {start}: settled at {s}");
        }
    }

    #[test]
    fn the_share_follows_a_moved_balance_and_holds_on_a_split_vote() {
        let step = 64.0 / 14336.0;
        let mut b = PcieBalance::default();
        let run = |b: &mut PcieBalance, cpu: f32, link: f32, tokens: usize| {
            for _ in 0..tokens {
                let s = b.share(0.5, step);
                for _ in 0..32 {
                    b.vote(gpu_done(s, cpu, link), 32, step);
                }
            }
            b.current().unwrap()
        };
        let s1 = run(&mut b, 1.0, 1.0, 300);
        assert!((s1 - 0.5).abs() <= 2.0 * step, "{s1}");
        let s2 = run(&mut b, 1.0, 3.0, 300); // the link got 3× slower: balance at 0.25
        assert!((s2 - 0.25).abs() <= 2.0 * step, "{s2}");
        // half the layers each way: no move
        let before = b;
        for i in 0..32 {
            b.vote(i % 2 == 0, 32, step);
        }
        assert_eq!(b.current(), before.current());
    }

    #[test]
    fn the_first_move_is_at_least_one_row_step() {
        // Qwen3-like: one 64-row step is 1/12 of the rows, more than the default first step (1/16)
        let step = 64.0 / 768.0;
        let mut b = PcieBalance::default();
        assert_eq!(b.share(0.5, step), 0.5);
        b.vote(true, 1, step);
        assert!((b.current().unwrap() - (0.5 + step)).abs() < 1e-6);
    }

    #[test]
    fn the_share_stays_inside_one_step_of_the_ends() {
        let step = 0.25;
        let mut b = PcieBalance::default();
        assert_eq!(b.share(0.0, step), 0.25);
        for _ in 0..100 {
            b.vote(false, 1, step);
        }
        assert_eq!(b.current(), Some(0.25));
        for _ in 0..100 {
            b.vote(true, 1, step);
        }
        assert_eq!(b.current(), Some(0.75));
    }
}
