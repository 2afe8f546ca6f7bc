//! The TERAIO planner: iterative greedy over (tensor, inactive period) candidates by
//! benefit / cost, bandwidth-aware through a per-slot [`Ledger`], SSD first and host memory when
//! the SSD's bandwidth is taken.
//!
//! benefit = critical pressure removed, integrated over the slots where the tensor is really
//! gone (after its offload completes, before its prefetch starts); cost = offload time +
//! prefetch time. Benefits only shrink as rounds commit migrations (pressure falls, bandwidth
//! fills), so candidates sit in a max-heap keyed by their last score and are re-evaluated only
//! when they reach the top (lazy greedy): a candidate is taken when its fresh score is within a
//! small tolerance of the next key.
//!
//! Beyond the paper:
//! - clean drops: a period whose tensor already has an up-to-date SSD copy (written in an earlier
//!   planned period with only reads since, e.g. a weight between forward and backward) is dropped
//!   instead of written again;
//! - stall repair: when bandwidth-feasible migrations cannot make the iteration fit (the paper
//!   then lets the runtime stall), the planner repairs the slot with the largest excess by the
//!   cheapest change that frees memory there: move a planned prefetch to just before the use,
//!   move a planned offload to right after the last use, or plan a new period that way; each
//!   such transfer is marked urgent and its time counted as an expected stall.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::hardware::Hardware;
use crate::ledger::{channel_index, Direction, Ledger, Span};
use crate::lifetime::{base_pressure_bytes, copy_still_valid, inactive_periods, InactivePeriod, Timeline};
use crate::plan::{Migration, Plan, Tier};
use crate::pressure::PressureTree;
use crate::sim::{simulate, Outcome, Policy, SimConfig};
use crate::trace::Trace;

/// Planner settings. Fields missing from a JSON request take their defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlannerConfig {
    /// Drop tensors whose SSD copy is still valid instead of writing them again (default true;
    /// false reproduces the paper's algorithm).
    pub clean_drop: bool,
    /// Use the SSD while its window gives at least this fraction of the host window's benefit
    /// (default 0.5); below it the SSD counts as saturated and host memory is used.
    pub ssd_preference: f64,
    /// GPU memory kept free for fragmentation and the allocator's slack (default 0).
    pub reserve_bytes: u64,
    /// Limit on candidate evaluations, as a multiple of the candidate count (default 64).
    pub evaluations_per_candidate_max: usize,
    /// Lazy greedy: take a re-evaluated candidate when its score is within this fraction of the
    /// next candidate's (stale, upper-bound) score (default 0.05).
    pub lazy_tolerance: f64,
    /// When bandwidth-feasible migrations cannot make the iteration fit, repair with migrations
    /// that stall the GPU (default true). Without it such a plan does not fit.
    pub allow_stalls: bool,
    /// Issue each prefetch earlier than the latest feasible point by up to this multiple of its
    /// transfer time, where GPU memory has room (default 1.0; 0 gives the paper's placement).
    /// Slack absorbs queueing the per-slot bandwidth model does not see.
    pub prefetch_slack: f64,
    /// Which tier a period goes to when both can take it (default `Ssd`: the paper's order).
    #[serde(default)]
    pub tier_preference: TierPreference,
}

/// Which tier the greedy tries to fill first when a period fits both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TierPreference {
    /// SSD first, host memory once the SSD's window falls below `ssd_preference` of the host's
    /// (the paper: host memory is the scarce tier, kept for what the SSD cannot take).
    #[default]
    Ssd,
    /// Host memory first, the SSD once host memory is full or its window falls below
    /// `ssd_preference` of the SSD's: host copies are faster and cost no drive time.
    Host,
    /// Both, keeping the plan the simulator predicts faster (planning takes twice as long).
    Auto,
}

impl std::str::FromStr for TierPreference {
    type Err = Error;
    fn from_str(text: &str) -> Result<Self> {
        match text {
            "ssd" => Ok(TierPreference::Ssd),
            "host" => Ok(TierPreference::Host),
            "auto" => Ok(TierPreference::Auto),
            other => {
                Err(Error::Config(format!("tier_preference must be \"ssd\", \"host\" or \"auto\", not {other:?}")))
            }
        }
    }
}

impl TierPreference {
    /// The names [`str::parse`] takes, as the CLI and Python spell them.
    pub const NAMES: [&'static str; 3] = ["ssd", "host", "auto"];
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            clean_drop: true,
            ssd_preference: 0.5,
            reserve_bytes: 0,
            evaluations_per_candidate_max: 64,
            lazy_tolerance: 0.05,
            allow_stalls: true,
            prefetch_slack: 1.0,
            tier_preference: TierPreference::Ssd,
        }
    }
}

impl PlannerConfig {
    /// The same settings with the paper's algorithm: every offload writes, prefetches at the
    /// latest feasible point.
    pub fn paper(self) -> Self {
        PlannerConfig { clean_drop: false, prefetch_slack: 0.0, ..self }
    }
}

/// A plan with the planner's own view of it.
#[derive(Debug, Clone)]
pub struct PlanOutcome {
    /// The plan.
    pub plan: Plan,
    /// Bandwidth and host memory committed per slot.
    pub ledger: Ledger,
    /// GPU memory per op with no migration.
    pub base_pressure_bytes: Vec<u64>,
    /// GPU memory per op under the plan (stall-free timing).
    pub planned_pressure_bytes: Vec<u64>,
    /// Candidates considered.
    pub candidate_count: usize,
    /// Candidate evaluations done.
    pub evaluation_count: usize,
    /// Changes made by the stall repair.
    pub repair_count: usize,
    /// GPU time the planner expects to wait for stalling transfers (their transfer times).
    pub expected_stall_us: f64,
}

/// One way to offload one period.
#[derive(Debug, Clone, Copy)]
struct Evaluation {
    tier: Tier,
    writes: bool,
    write_span: Option<Span>,
    read_span: Span,
    /// The write does not fit in the bandwidth: it is issued at once and the GPU may wait.
    write_stalls: bool,
    /// The read does not fit in the bandwidth: it is issued just before the use.
    read_stalls: bool,
    absent_from_slot: u32,
    absent_to_slot: u32,
    benefit_byte_us: f64,
    score: f64,
}

/// A planned period and what it holds in the ledger.
#[derive(Debug, Clone)]
struct Record {
    evaluation: Evaluation,
    write_taken: Vec<(u32, f64)>,
    read_taken: Vec<(u32, f64)>,
}

#[derive(Debug, Clone, Copy)]
struct HeapEntry {
    score: f64,
    candidate: u32,
}

impl PartialEq for HeapEntry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for HeapEntry {}
impl PartialOrd for HeapEntry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for HeapEntry {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.candidate.cmp(&self.candidate))
    }
}

/// A change the stall repair can make.
#[derive(Debug, Clone, Copy)]
enum Repair {
    /// Plan an unplanned period with stalling transfers.
    Plan(u32, Evaluation),
    /// Move a planned prefetch to just before the use.
    LatePrefetch(u32),
    /// Issue a planned offload at once.
    EarlyOffload(u32),
}

struct Planner<'a> {
    trace: &'a Trace,
    hardware: &'a Hardware,
    config: PlannerConfig,
    slot_count: u32,
    pressure: PressureTree,
    ledger: Ledger,
    periods: Vec<InactivePeriod>,
    /// Per tensor: (after_use, tier) of the periods planned so far.
    planned_periods: Vec<Vec<(u32, Tier)>>,
    /// Per candidate: its plan, if planned.
    records: Vec<Option<Record>>,
    /// Transfer time of stalling transfers planned so far, per tier.
    stalled_us: [f64; 2],
    evaluation_count: usize,
    /// Both tiers can take a period: host memory first (`TierPreference`, resolved).
    host_first: bool,
}

impl Planner<'_> {
    fn size_bytes(&self, candidate: u32) -> u64 {
        self.trace.tensors[self.periods[candidate as usize].tensor as usize].size_bytes
    }

    fn rates(&self, tier: Tier) -> (f64, f64, f64) {
        match tier {
            Tier::Ssd => {
                (self.hardware.ssd_write_bytes_per_s, self.hardware.ssd_read_bytes_per_s, self.hardware.ssd_latency_us)
            }
            Tier::Host => (
                self.hardware.host_link_bytes_per_s,
                self.hardware.host_link_bytes_per_s,
                self.hardware.host_latency_us,
            ),
        }
    }

    fn write_us(&self, tier: Tier, size_bytes: u64) -> f64 {
        let (write_rate, _, latency_us) = self.rates(tier);
        size_bytes as f64 / write_rate * 1e6 + latency_us
    }

    fn read_us(&self, tier: Tier, size_bytes: u64) -> f64 {
        let (_, read_rate, latency_us) = self.rates(tier);
        size_bytes as f64 / read_rate * 1e6 + latency_us
    }

    /// True when an SSD copy written in an earlier planned period is still valid when `period`
    /// starts (only reads in between).
    fn has_clean_ssd_copy(&self, period: &InactivePeriod) -> bool {
        let planned = &self.planned_periods[period.tensor as usize];
        !planned.is_empty()
            && copy_still_valid(&self.trace.tensors[period.tensor as usize], period.after_use, |after_use| {
                planned.contains(&(after_use, Tier::Ssd))
            })
    }

    /// Offloading `period` to `tier`: bandwidth-feasible windows, or (`stalling`) a write issued
    /// at once and a read issued just before the use, whatever bandwidth is left.
    fn evaluate_tier(&mut self, period: &InactivePeriod, tier: Tier, stalling: bool) -> Option<Evaluation> {
        self.evaluation_count += 1;
        let size_bytes = self.trace.tensors[period.tensor as usize].size_bytes;
        let (start, end) = (period.start_slot, period.end_slot);
        if tier == Tier::Host && !self.ledger.host_fits(size_bytes, start, end) {
            return None;
        }
        let write_channel = channel_index(tier, Direction::Write);
        let read_channel = channel_index(tier, Direction::Read);
        let clean = self.config.clean_drop && tier == Tier::Ssd && self.has_clean_ssd_copy(period);
        let (write_span, absent_from_slot) = if clean {
            (None, start)
        } else if stalling {
            (Some(Span { first_slot: start, last_slot: start }), start + 1)
        } else {
            let span = self.ledger.fit_forward(write_channel, size_bytes, start, end - 1)?;
            (Some(span), span.last_slot + 1)
        };
        if absent_from_slot + 1 >= end {
            return None;
        }
        let read_span = if stalling {
            Span { first_slot: end - 1, last_slot: end - 1 }
        } else {
            self.ledger.fit_backward(read_channel, size_bytes, end, absent_from_slot)?
        };
        let absent_to_slot = read_span.first_slot;
        if absent_to_slot <= absent_from_slot {
            return None;
        }
        let benefit_byte_us = self.pressure.benefit(absent_from_slot, absent_to_slot, size_bytes);
        if benefit_byte_us <= 0.0 {
            return None;
        }
        let read_us = self.read_us(tier, size_bytes);
        let write_us = if clean { 0.0 } else { self.write_us(tier, size_bytes) };
        // A stalling transfer costs its time twice: on the channel and as GPU idle time.
        let cost_us = if stalling { 2.0 } else { 1.0 } * (read_us + write_us);
        Some(Evaluation {
            tier,
            writes: !clean,
            write_span,
            read_span,
            write_stalls: stalling && !clean,
            read_stalls: stalling,
            absent_from_slot,
            absent_to_slot,
            benefit_byte_us,
            score: benefit_byte_us / cost_us,
        })
    }

    /// The candidate's best offload now: SSD unless its bandwidth is taken, then host memory.
    fn evaluate(&mut self, candidate: u32, stalling: bool) -> Option<Evaluation> {
        let period = self.periods[candidate as usize];
        let ssd = self.evaluate_tier(&period, Tier::Ssd, stalling);
        let host = if self.hardware.host_capacity_bytes > 0 {
            self.evaluate_tier(&period, Tier::Host, stalling)
        } else {
            None
        };
        match (ssd, host) {
            (Some(s), Some(h)) if stalling => {
                // Stalling transfers queue up: spread them over both tiers' links.
                let size_bytes = self.size_bytes(candidate);
                let finish = |planner: &Self, tier: Tier| {
                    planner.stalled_us[tier.index()]
                        + planner.read_us(tier, size_bytes)
                        + planner.write_us(tier, size_bytes)
                };
                Some(if finish(self, Tier::Host) < finish(self, Tier::Ssd) { h } else { s })
            }
            (Some(s), Some(h)) if self.host_first => {
                if h.benefit_byte_us >= self.config.ssd_preference * s.benefit_byte_us {
                    Some(h)
                } else {
                    Some(s)
                }
            }
            (Some(s), Some(h)) => {
                if s.benefit_byte_us >= self.config.ssd_preference * h.benefit_byte_us {
                    Some(s)
                } else {
                    Some(h)
                }
            }
            (s, h) => s.or(h),
        }
    }

    fn accept(&mut self, candidate: u32, evaluation: Evaluation) {
        let period = self.periods[candidate as usize];
        let size_bytes = self.size_bytes(candidate);
        let tier = evaluation.tier;
        let write_channel = channel_index(tier, Direction::Write);
        let read_channel = channel_index(tier, Direction::Read);
        let mut write_taken = Vec::new();
        if let Some(span) = evaluation.write_span {
            if evaluation.write_stalls {
                self.ledger.record_stall(write_channel, span.first_slot, size_bytes);
                self.stalled_us[tier.index()] += self.write_us(tier, size_bytes);
            } else {
                write_taken = self.ledger.commit(write_channel, size_bytes, span, true);
            }
        }
        let span = evaluation.read_span;
        let read_taken = if evaluation.read_stalls {
            self.ledger.record_stall(read_channel, span.first_slot, size_bytes);
            self.stalled_us[tier.index()] += self.read_us(tier, size_bytes);
            Vec::new()
        } else {
            self.ledger.commit(read_channel, size_bytes, span, false)
        };
        if tier == Tier::Host {
            self.ledger.hold_host(size_bytes, period.start_slot, period.end_slot);
        }
        self.pressure.add(evaluation.absent_from_slot, evaluation.absent_to_slot, -(size_bytes as i64));
        self.planned_periods[period.tensor as usize].push((period.after_use, tier));
        self.records[candidate as usize] = Some(Record { evaluation, write_taken, read_taken });
    }

    /// Lazy-greedy rounds over bandwidth-feasible migrations.
    fn greedy(&mut self) {
        let candidate_count = self.periods.len();
        let evaluations_max = candidate_count.saturating_mul(self.config.evaluations_per_candidate_max);
        let mut heap = BinaryHeap::with_capacity(candidate_count);
        for candidate in 0..candidate_count as u32 {
            if let Some(evaluation) = self.evaluate(candidate, false) {
                heap.push(HeapEntry { score: evaluation.score, candidate });
            }
        }
        let keep = 1.0 - self.config.lazy_tolerance.clamp(0.0, 1.0);
        while self.pressure.max_excess_bytes() > 0 && self.evaluation_count < evaluations_max {
            let Some(top) = heap.pop() else { break };
            let Some(evaluation) = self.evaluate(top.candidate, false) else { continue };
            let next_score = heap.peek().map_or(f64::NEG_INFINITY, |entry| entry.score);
            if evaluation.score >= next_score * keep {
                self.accept(top.candidate, evaluation);
            } else {
                heap.push(HeapEntry { score: evaluation.score, candidate: top.candidate });
            }
        }
    }

    /// The virtual slot of plain slot `slot` inside `period`, if the period covers it.
    fn virtual_slot_in(&self, period: &InactivePeriod, slot: u32) -> Option<u32> {
        [slot, slot + self.slot_count].into_iter().find(|&v| period.start_slot <= v && v < period.end_slot)
    }

    /// Repairs for `slot`, best first (memory freed there per second of stall).
    fn repairs_for(&mut self, slot: u32) -> Vec<(f64, Repair)> {
        let mut options = Vec::new();
        for candidate in 0..self.periods.len() as u32 {
            let period = self.periods[candidate as usize];
            let Some(v) = self.virtual_slot_in(&period, slot) else { continue };
            if let Some(repair) = self.repair_option(candidate, v) {
                options.push(repair);
            }
        }
        options.sort_by(|a, b| b.0.total_cmp(&a.0));
        options
    }

    /// The best repair of `candidate` that frees its memory in virtual slot `v`.
    fn repair_option(&mut self, candidate: u32, v: u32) -> Option<(f64, Repair)> {
        let period = self.periods[candidate as usize];
        let size_bytes = self.size_bytes(candidate);
        match self.records[candidate as usize].as_ref().map(|r| r.evaluation) {
            None => {
                let evaluation = self.evaluate(candidate, true)?;
                (evaluation.absent_from_slot <= v && v < evaluation.absent_to_slot)
                    .then_some((evaluation.score, Repair::Plan(candidate, evaluation)))
            }
            Some(evaluation) => {
                let late_to = period.end_slot - 1;
                if evaluation.absent_to_slot <= v && v < late_to {
                    let gain = self.pressure.benefit(evaluation.absent_to_slot, late_to, size_bytes);
                    let cost = self.read_us(evaluation.tier, size_bytes);
                    return (gain > 0.0).then_some((gain / cost, Repair::LatePrefetch(candidate)));
                }
                let early_from = period.start_slot + 1;
                if evaluation.writes && early_from <= v && v < evaluation.absent_from_slot {
                    let gain = self.pressure.benefit(early_from, evaluation.absent_from_slot, size_bytes);
                    let cost = self.write_us(evaluation.tier, size_bytes);
                    return (gain > 0.0).then_some((gain / cost, Repair::EarlyOffload(candidate)));
                }
                None
            }
        }
    }

    fn apply_repair(&mut self, repair: Repair) {
        match repair {
            Repair::Plan(candidate, evaluation) => self.accept(candidate, evaluation),
            Repair::LatePrefetch(candidate) => {
                let period = self.periods[candidate as usize];
                let size_bytes = self.size_bytes(candidate);
                let Some(record) = self.records[candidate as usize].as_mut() else { return };
                let channel = channel_index(record.evaluation.tier, Direction::Read);
                let taken = std::mem::take(&mut record.read_taken);
                let old_to = record.evaluation.absent_to_slot;
                let late = period.end_slot - 1;
                record.evaluation.absent_to_slot = late;
                record.evaluation.read_span = Span { first_slot: late, last_slot: late };
                record.evaluation.read_stalls = true;
                let tier = record.evaluation.tier;
                self.ledger.uncommit(channel, &taken);
                self.ledger.record_stall(channel, late, size_bytes);
                self.stalled_us[tier.index()] += self.read_us(tier, size_bytes);
                self.pressure.add(old_to, late, -(size_bytes as i64));
            }
            Repair::EarlyOffload(candidate) => {
                let period = self.periods[candidate as usize];
                let size_bytes = self.size_bytes(candidate);
                let Some(record) = self.records[candidate as usize].as_mut() else { return };
                let channel = channel_index(record.evaluation.tier, Direction::Write);
                let taken = std::mem::take(&mut record.write_taken);
                let old_from = record.evaluation.absent_from_slot;
                let start = period.start_slot;
                record.evaluation.absent_from_slot = start + 1;
                record.evaluation.write_span = Some(Span { first_slot: start, last_slot: start });
                record.evaluation.write_stalls = true;
                let tier = record.evaluation.tier;
                self.ledger.uncommit(channel, &taken);
                self.ledger.record_stall(channel, start, size_bytes);
                self.stalled_us[tier.index()] += self.write_us(tier, size_bytes);
                self.pressure.add(start + 1, old_from, -(size_bytes as i64));
            }
        }
    }

    /// Repairs over-capacity slots with stalling transfers, worst slot first; returns the
    /// changes made.
    fn repair(&mut self) -> usize {
        let mut repairs = 0;
        let n = self.slot_count;
        // Every round fixes the worst slot or gives up, and fixed slots only get better.
        for _ in 0..n {
            if self.pressure.max_excess_bytes() <= 0 {
                break;
            }
            let slot = self.pressure.argmax_excess() as u32;
            let mut progressed = false;
            for (_, option) in self.repairs_for(slot) {
                if self.pressure.max_excess_in(slot, slot + 1) <= 0 {
                    break;
                }
                // Options were scored before earlier ones were applied: re-check each.
                let candidate = match option {
                    Repair::Plan(c, _) | Repair::LatePrefetch(c) | Repair::EarlyOffload(c) => c,
                };
                let period = self.periods[candidate as usize];
                let Some(v) = self.virtual_slot_in(&period, slot) else { continue };
                if let Some((_, fresh)) = self.repair_option(candidate, v) {
                    self.apply_repair(fresh);
                    repairs += 1;
                    progressed = true;
                }
            }
            if !progressed || self.pressure.max_excess_in(slot, slot + 1) > 0 {
                break;
            }
        }
        repairs
    }

    /// Moves prefetches earlier where memory has room (see [`PlannerConfig::prefetch_slack`]).
    fn add_prefetch_slack(&mut self, timeline: &Timeline) {
        if self.config.prefetch_slack <= 0.0 {
            return;
        }
        let n = self.slot_count;
        for candidate in 0..self.records.len() {
            let Some(record) = &self.records[candidate] else { continue };
            let evaluation = record.evaluation;
            let size_bytes = self.size_bytes(candidate as u32);
            let slack_us = self.config.prefetch_slack * self.read_us(evaluation.tier, size_bytes);
            let old_to = evaluation.absent_to_slot;
            let mut new_to = old_to;
            let mut moved_us = 0.0;
            while new_to > evaluation.absent_from_slot + 1 && moved_us < slack_us {
                let slot = new_to - 1;
                if self.pressure.max_excess_in(slot, slot + 1) + size_bytes as i64 > 0 {
                    break;
                }
                moved_us += timeline.duration_us[(slot % n) as usize];
                new_to = slot;
            }
            if new_to < old_to {
                self.pressure.add(new_to, old_to, size_bytes as i64);
                if let Some(record) = self.records[candidate].as_mut() {
                    record.evaluation.absent_to_slot = new_to;
                }
            }
        }
    }

    fn migration(&self, candidate: u32, record: &Record) -> Migration {
        let period = self.periods[candidate as usize];
        let tensor = &self.trace.tensors[period.tensor as usize];
        let evaluation = &record.evaluation;
        let n = self.slot_count;
        let start = period.start_slot;
        Migration {
            tensor_id: tensor.id,
            tensor_index: period.tensor,
            tier: evaluation.tier,
            offload_op: start % n,
            writes: evaluation.writes,
            prefetch_op: evaluation.absent_to_slot % n,
            next_use_op: period.end_slot % n,
            absent_from_slot: evaluation.absent_from_slot,
            absent_to_slot: evaluation.absent_to_slot,
            wraps: period.end_slot > n,
            offloaded_at_start: period.end_slot > n && evaluation.absent_to_slot >= n,
            offload_urgent: evaluation.writes && evaluation.absent_from_slot == start + 1,
            prefetch_urgent: evaluation.absent_to_slot + 1 == period.end_slot,
            offload_stalls: evaluation.write_stalls,
            prefetch_stalls: evaluation.read_stalls,
        }
    }
}

/// Plans migrations so that the trace fits in `hardware.gpu_capacity_bytes`.
pub fn plan_teraio(trace: &Trace, hardware: &Hardware, config: PlannerConfig) -> Result<PlanOutcome> {
    trace.validate()?;
    hardware.validate()?;
    match config.tier_preference {
        TierPreference::Ssd => Ok(plan_in_order(trace, hardware, config, false)),
        TierPreference::Host => Ok(plan_in_order(trace, hardware, config, true)),
        TierPreference::Auto => {
            // The greedy is myopic about which tier to fill first (taking host memory early can
            // leave later periods worse off, or better): plan both ways and let the simulator
            // choose. A plan that fits beats one that does not; a tie keeps the paper's order.
            let ssd_first = plan_in_order(trace, hardware, config, false);
            let host_first = plan_in_order(trace, hardware, config, true);
            let predict = |outcome: &PlanOutcome| -> Result<(bool, f64)> {
                let report = simulate(trace, hardware, Policy::Planned(&outcome.plan), SimConfig::default())?;
                let completed = report.outcome == Outcome::Completed;
                Ok((outcome.plan.fits && completed, report.iteration_time_us))
            };
            let (ssd_fits, ssd_us) = predict(&ssd_first)?;
            let (host_fits, host_us) = predict(&host_first)?;
            Ok(if (host_fits, -host_us) > (ssd_fits, -ssd_us) { host_first } else { ssd_first })
        }
    }
}

/// The greedy and its repairs with one tier order (`host_first`: host memory first).
fn plan_in_order(trace: &Trace, hardware: &Hardware, config: PlannerConfig, host_first: bool) -> PlanOutcome {
    let timeline = Timeline::new(trace);
    let base = base_pressure_bytes(trace);
    let capacity_bytes = hardware.gpu_capacity_bytes.saturating_sub(config.reserve_bytes);
    let periods = inactive_periods(trace);
    let candidate_count = periods.len();

    let mut planner = Planner {
        trace,
        hardware,
        config,
        slot_count: timeline.slot_count() as u32,
        ledger: Ledger::new(&timeline, hardware),
        pressure: PressureTree::new(&base, capacity_bytes, &timeline.duration_us),
        periods,
        planned_periods: vec![Vec::new(); trace.tensors.len()],
        records: vec![None; candidate_count],
        stalled_us: [0.0; 2],
        evaluation_count: 0,
        host_first,
    };
    if planner.pressure.max_excess_bytes() > 0 {
        planner.greedy();
    }
    let repair_count =
        if config.allow_stalls && planner.pressure.max_excess_bytes() > 0 { planner.repair() } else { 0 };
    if planner.pressure.max_excess_bytes() <= 0 {
        planner.add_prefetch_slack(&timeline);
    }
    let mut migrations = Vec::new();
    let mut expected_stall_us = 0.0;
    for (candidate, record) in planner.records.iter().enumerate() {
        if let Some(record) = record {
            let migration = planner.migration(candidate as u32, record);
            let size_bytes = planner.size_bytes(candidate as u32);
            if migration.offload_stalls {
                expected_stall_us += planner.write_us(migration.tier, size_bytes);
            }
            if migration.prefetch_stalls {
                expected_stall_us += planner.read_us(migration.tier, size_bytes);
            }
            migrations.push(migration);
        }
    }
    let fits = planner.pressure.max_excess_bytes() <= 0;
    let capacity = capacity_bytes as i64;
    let planned: Vec<u64> =
        planner.pressure.excess_per_slot().into_iter().map(|excess| (excess + capacity).max(0) as u64).collect();
    let peak = planned.iter().copied().max().unwrap_or(0);
    let policy = if config == config.paper() { "teraio-paper" } else { "teraio" };
    let mut plan = Plan::new(policy, trace, hardware.gpu_capacity_bytes, peak, migrations);
    plan.fits = fits;
    PlanOutcome {
        plan,
        ledger: planner.ledger,
        base_pressure_bytes: base,
        planned_pressure_bytes: planned,
        candidate_count,
        evaluation_count: planner.evaluation_count,
        repair_count,
        expected_stall_us,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{simulate, Outcome, Policy, SimConfig};
    use crate::trace::{Access, Op, Phase, Tensor, TensorKind, TensorUse, FORMAT_VERSION};
    use teraio_units::ReadWriteBandwidth;

    const MB: u64 = 1_000_000;

    fn use_at(op: u32, access: Access) -> TensorUse {
        TensorUse { op, access }
    }

    fn trace(op_count: usize, tensors: Vec<Tensor>) -> Trace {
        Trace {
            format_version: FORMAT_VERSION,
            description: String::new(),
            gpu_capacity_bytes: 150 * MB,
            ops: (0..op_count)
                .map(|i| Op { name: format!("op{i}"), duration_us: 1000.0, layer: None, phase: Phase::Other })
                .collect(),
            tensors,
        }
    }

    fn temporary(id: u64, op: u32) -> Tensor {
        Tensor {
            id,
            name: format!("temp{id}"),
            size_bytes: 100 * MB,
            kind: TensorKind::Temporary,
            alloc_op: Some(op),
            free_op: Some(op),
            uses: vec![use_at(op, Access::Write)],
        }
    }

    fn hardware(bytes_per_s: f64) -> Hardware {
        let ssd = ReadWriteBandwidth { read_bytes_per_s: bytes_per_s, write_bytes_per_s: bytes_per_s };
        Hardware::new(150 * MB, ssd, 0)
    }

    #[test]
    fn a_period_over_the_peak_is_offloaded_and_back_in_time() {
        // 100 MB activation live over ops 0..=5; a 100 MB temporary at op 2 overflows 150 MB.
        let activation = Tensor {
            id: 1,
            name: "a".into(),
            size_bytes: 100 * MB,
            kind: TensorKind::Activation,
            alloc_op: Some(0),
            free_op: Some(5),
            uses: vec![use_at(0, Access::Write), use_at(5, Access::Read)],
        };
        let trace = trace(6, vec![activation, temporary(2, 2)]);
        // 200 GB/s: 200 MB per 1 ms op, so each transfer fits in one op.
        let hardware = hardware(200e9);
        let outcome = plan_teraio(&trace, &hardware, PlannerConfig::default()).unwrap();
        let plan = &outcome.plan;
        assert!(plan.fits);
        assert_eq!(plan.migrations.len(), 1);
        let migration = plan.migrations[0];
        assert_eq!((migration.tensor_id, migration.tier, migration.offload_op), (1, Tier::Ssd, 1));
        assert!(migration.absent_from_slot <= 2 && migration.absent_to_slot > 2);
        assert_eq!(outcome.repair_count, 0);
        let report = simulate(&trace, &hardware, Policy::Planned(plan), SimConfig::default()).unwrap();
        assert_eq!(report.outcome, Outcome::Completed);
        assert_eq!(report.stall_time_us, 0.0);
        assert!(report.peak_gpu_bytes <= 150 * MB);
    }

    #[test]
    fn too_little_bandwidth_is_repaired_with_stalls() {
        let activation = Tensor {
            id: 1,
            name: "a".into(),
            size_bytes: 100 * MB,
            kind: TensorKind::Activation,
            alloc_op: Some(0),
            free_op: Some(5),
            uses: vec![use_at(0, Access::Write), use_at(5, Access::Read)],
        };
        let trace = trace(6, vec![activation, temporary(2, 2)]);
        // 10 GB/s: 10 MB per op; 100 MB cannot leave and come back within the gap.
        let hardware = hardware(10e9);
        let feasible_only = PlannerConfig { allow_stalls: false, ..PlannerConfig::default() };
        assert!(!plan_teraio(&trace, &hardware, feasible_only).unwrap().plan.fits);
        let outcome = plan_teraio(&trace, &hardware, PlannerConfig::default()).unwrap();
        assert!(outcome.plan.fits);
        assert!(outcome.repair_count > 0);
        assert!(outcome.expected_stall_us > 0.0);
        let report = simulate(&trace, &hardware, Policy::Planned(&outcome.plan), SimConfig::default()).unwrap();
        assert_eq!(report.outcome, Outcome::Completed);
        assert!(report.stall_time_us > 0.0);
    }

    #[test]
    fn an_unchanged_ssd_copy_is_dropped_not_written_again() {
        // A weight written at op 0, read at ops 4 and 8; temporaries at ops 2 and 6 overflow.
        let weight = Tensor {
            id: 1,
            name: "w".into(),
            size_bytes: 100 * MB,
            kind: TensorKind::Weight,
            alloc_op: None,
            free_op: None,
            uses: vec![use_at(0, Access::Write), use_at(4, Access::Read), use_at(8, Access::Read)],
        };
        let trace = trace(10, vec![weight, temporary(2, 2), temporary(3, 6)]);
        let hardware = hardware(200e9);
        let plan = plan_teraio(&trace, &hardware, PlannerConfig::default()).unwrap().plan;
        assert!(plan.fits);
        let writes: Vec<bool> = plan.migrations.iter().map(|m| m.writes).collect();
        assert_eq!(writes, vec![true, false]);
        let report = simulate(&trace, &hardware, Policy::Planned(&plan), SimConfig::default()).unwrap();
        assert_eq!(report.outcome, Outcome::Completed);
        assert_eq!(report.downgraded_drops, 0);
        assert_eq!(report.ssd_written_bytes, 100 * MB);
        let paper = plan_teraio(&trace, &hardware, PlannerConfig::default().paper()).unwrap().plan;
        assert!(paper.migrations.iter().all(|m| m.writes));
    }
}
