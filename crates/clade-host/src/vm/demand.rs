//! Recent demand for standby VMMs, per template: what the pool grows
//! toward and shrinks back from.
//!
//! Every create or fork child that could take a standby counts, whether one
//! was ready or not. Demand is the most VMs asked for within any
//! [`BURST_WINDOW_SECS`] of the horizon (by default [`HORIZON_SECS`]): a
//! burst of ten creates keeps ten standbys ready for the next ten minutes,
//! however long the client pauses in between, and once the burst is older
//! than the horizon the pool lets them go. Counts are kept per second, so
//! that a key's memory is bounded by the horizon, not by the number of
//! creates.

use std::collections::VecDeque;

/// VMs asked for within this span count as one burst.
pub const BURST_WINDOW_SECS: u64 = 10;
/// How long a burst keeps the pool grown after it, unless told otherwise.
pub const HORIZON_SECS: u64 = 600;

/// Takes per second over the horizon, for one template and lifetime.
#[derive(Debug)]
pub(super) struct Demand {
    horizon: u64,
    /// (second, takes in it), oldest first, only seconds that had some.
    seconds: VecDeque<(u64, u32)>,
}

impl Default for Demand {
    fn default() -> Self {
        Self::new(HORIZON_SECS)
    }
}

impl Demand {
    /// Demand remembered for `horizon` seconds (at least one burst window).
    pub fn new(horizon: u64) -> Self {
        Self { horizon: horizon.max(BURST_WINDOW_SECS), seconds: VecDeque::new() }
    }

    /// Counts one VM asked for at `now` (seconds on a monotonic clock).
    pub fn record(&mut self, now: u64) {
        self.forget_before(now);
        match self.seconds.back_mut() {
            Some((second, takes)) if *second == now => *takes += 1,
            _ => self.seconds.push_back((now, 1)),
        }
    }

    /// The most VMs asked for within any burst window of the horizon that
    /// ends at `now`; 0 when none was asked for.
    pub fn peak(&mut self, now: u64) -> usize {
        self.forget_before(now);
        let (mut peak, mut in_window, mut first) = (0, 0usize, 0);
        for (last, &(second, takes)) in self.seconds.iter().enumerate() {
            in_window += takes as usize;
            while self.seconds[first].0 + BURST_WINDOW_SECS <= second {
                in_window -= self.seconds[first].1 as usize;
                first += 1;
            }
            debug_assert!(first <= last);
            peak = peak.max(in_window);
        }
        peak
    }

    /// Whether nothing was asked for within the horizon.
    pub fn is_empty(&mut self, now: u64) -> bool {
        self.forget_before(now);
        self.seconds.is_empty()
    }

    fn forget_before(&mut self, now: u64) {
        while self.seconds.front().is_some_and(|&(second, _)| second + self.horizon <= now) {
            self.seconds.pop_front();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(at: &[u64]) -> Demand {
        let mut demand = Demand::default();
        for &second in at {
            demand.record(second);
        }
        demand
    }

    #[test]
    fn no_demand_is_a_peak_of_zero() {
        assert_eq!(Demand::default().peak(100), 0);
        assert!(Demand::default().is_empty(100));
    }

    #[test]
    fn a_burst_is_the_takes_within_one_window() {
        // Ten back-to-back creates over three seconds, then one more later.
        let mut demand = asked(&[100, 100, 100, 101, 101, 101, 102, 102, 102, 102, 200]);
        assert_eq!(demand.peak(200), 10);
    }

    #[test]
    fn takes_further_apart_than_the_window_are_separate_bursts() {
        let spread: Vec<u64> = (0..6).map(|i| 1000 + i * BURST_WINDOW_SECS).collect();
        assert_eq!(asked(&spread).peak(1100), 1);
        // The window's last second still counts with its first.
        assert_eq!(asked(&[1000, 1000 + BURST_WINDOW_SECS - 1]).peak(1100), 2);
    }

    #[test]
    fn a_burst_keeps_the_peak_until_the_horizon_passes_it() {
        let mut demand = asked(&[10, 10, 10, 10]);
        assert_eq!(demand.peak(10 + 60), 4, "an idle minute keeps the peak");
        assert_eq!(demand.peak(10 + HORIZON_SECS - 1), 4);
        assert_eq!(demand.peak(10 + HORIZON_SECS), 0, "the burst is past the horizon");
        assert!(demand.is_empty(10 + HORIZON_SECS));
    }

    #[test]
    fn memory_is_bounded_by_the_horizon_not_the_takes() {
        let mut demand = Demand::default();
        for i in 0..100_000u64 {
            demand.record(i / 100);
        }
        assert!(demand.seconds.len() <= HORIZON_SECS as usize, "{}", demand.seconds.len());
        assert_eq!(demand.peak(999), 100 * BURST_WINDOW_SECS as usize);
    }

    #[test]
    fn a_shorter_horizon_forgets_sooner_but_never_within_a_window() {
        let mut demand = Demand::new(30);
        demand.record(5);
        assert_eq!(demand.peak(34), 1);
        assert_eq!(demand.peak(35), 0);
        assert_eq!(Demand::new(1).horizon, BURST_WINDOW_SECS);
    }
}
