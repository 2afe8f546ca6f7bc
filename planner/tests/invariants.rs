//! Invariants of the planner and simulator on random traces (proptest).

use proptest::prelude::*;
use teraio_planner::baselines::{flashneuron_like, zero_infinity_like};
use teraio_planner::greedy::{plan_teraio, PlannerConfig, TierPreference};
use teraio_planner::hardware::{gpu_preset, Hardware};
use teraio_planner::lifetime::base_pressure_bytes;
use teraio_planner::sim::{simulate, Outcome, Policy, SimConfig};
use teraio_planner::synth::{generate, model_preset};
use teraio_planner::trace::{Access, Op, Phase, Tensor, TensorKind, TensorUse, Trace, FORMAT_VERSION};

/// One random tensor: kind, size in MB, op uses (any order, deduplicated later), write mask.
type TensorSpec = (u8, u64, Vec<u32>, Vec<bool>);

fn build_trace(op_durations_us: Vec<f64>, specs: Vec<TensorSpec>) -> Trace {
    let n = op_durations_us.len() as u32;
    let ops = op_durations_us
        .into_iter()
        .enumerate()
        .map(|(i, duration_us)| Op {
            name: format!("op{i}"),
            duration_us,
            layer: Some(i as u32 / 4),
            phase: Phase::Forward,
        })
        .collect();
    let mut tensors = Vec::new();
    for (index, (kind, size_mb, mut uses, writes)) in specs.into_iter().enumerate() {
        for u in &mut uses {
            *u %= n;
        }
        uses.sort_unstable();
        uses.dedup();
        let kind = match kind % 5 {
            0 => TensorKind::Weight,
            1 => TensorKind::OptimizerState,
            2 => TensorKind::Activation,
            3 => TensorKind::Gradient,
            _ => TensorKind::Temporary,
        };
        let persistent = matches!(kind, TensorKind::Weight | TensorKind::OptimizerState);
        let uses: Vec<TensorUse> = uses
            .iter()
            .enumerate()
            .map(|(i, &op)| TensorUse {
                op,
                access: if (!persistent && i == 0) || writes.get(i).copied().unwrap_or(false) {
                    Access::Write
                } else {
                    Access::Read
                },
            })
            .collect();
        let (alloc_op, free_op) =
            if persistent { (None, None) } else { (Some(uses[0].op), Some(uses[uses.len() - 1].op)) };
        tensors.push(Tensor {
            id: 1000 + index as u64,
            name: format!("t{index}"),
            size_bytes: size_mb * 1_000_000,
            kind,
            alloc_op,
            free_op,
            uses,
        });
    }
    Trace { format_version: FORMAT_VERSION, description: "random".into(), gpu_capacity_bytes: 0, ops, tensors }
}

fn trace_strategy() -> impl Strategy<Value = Trace> {
    (4usize..40).prop_flat_map(|op_count| {
        let durations = prop::collection::vec(1.0f64..5000.0, op_count);
        let tensor =
            (0u8..5, 1u64..200, prop::collection::vec(0u32..1000, 1..6), prop::collection::vec(any::<bool>(), 0..6));
        let tensors = prop::collection::vec(tensor, 1..30);
        (durations, tensors).prop_map(|(d, t)| build_trace(d, t))
    })
}

fn hardware_for(trace: &Trace, capacity_fraction: f64, host_mb: u64, ssd_gb_s: f64) -> Hardware {
    let peak = base_pressure_bytes(trace).into_iter().max().unwrap_or(1);
    let mut hardware = Hardware::new(
        ((peak as f64 * capacity_fraction) as u64).max(1),
        teraio_units::ReadWriteBandwidth { read_bytes_per_s: ssd_gb_s * 1e9, write_bytes_per_s: ssd_gb_s * 1e9 },
        host_mb * 1_000_000,
    );
    hardware.host_link_bytes_per_s = 12e9;
    hardware
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// When the plan says it fits, the replay completes, never exceeds capacity, never runs an
    /// op with a tensor away, and never needs a fetch the plan did not schedule.
    #[test]
    fn a_plan_that_fits_replays_within_capacity(
        trace in trace_strategy(),
        capacity_fraction in 0.3f64..1.0,
        host_mb in prop::sample::select(vec![0u64, 100, 1000]),
        ssd_gb_s in 0.5f64..30.0,
        clean_drop in any::<bool>(),
        ssd_shared in any::<bool>(),
        ssd_via_host_link in any::<bool>(),
        tier_preference in prop::sample::select(vec![TierPreference::Ssd, TierPreference::Host, TierPreference::Auto]),
    ) {
        trace.validate().unwrap();
        let mut hardware = hardware_for(&trace, capacity_fraction, host_mb, ssd_gb_s);
        hardware.ssd_shared = ssd_shared;
        hardware.ssd_via_host_link = ssd_via_host_link;
        let config = PlannerConfig { clean_drop, tier_preference, ..PlannerConfig::default() };
        let outcome = plan_teraio(&trace, &hardware, config).unwrap();
        let plan = &outcome.plan;
        let planned_peak = outcome.planned_pressure_bytes.iter().copied().max().unwrap();
        prop_assert_eq!(plan.fits, planned_peak <= hardware.gpu_capacity_bytes);
        let report = simulate(&trace, &hardware, Policy::Planned(plan), SimConfig::default()).unwrap();
        prop_assert!(report.peak_gpu_bytes <= hardware.gpu_capacity_bytes);
        prop_assert_eq!(report.residency_violations, 0);
        // TERAIO_DUMP=DIR keeps a failing case (trace.json, hw.json) for debugging.
        if let Ok(dir) = std::env::var("TERAIO_DUMP") {
            if plan.fits && report.outcome != Outcome::Completed {
                trace.save(std::path::Path::new(&format!("{dir}/trace.json"))).unwrap();
                std::fs::write(format!("{dir}/hw.json"), serde_json::to_string(&hardware).unwrap()).unwrap();
                std::fs::write(format!("{dir}/clean"), format!("{clean_drop}")).unwrap();
            }
        }
        if plan.fits {
            prop_assert_eq!(report.outcome, Outcome::Completed);
            prop_assert_eq!(report.demand_fetches, 0);
            prop_assert_eq!(report.downgraded_drops, 0);
            prop_assert!(report.iteration_time_us + 1e-6 >= trace.compute_time_us());
        }
    }

    /// Bandwidth-feasible commitments never exceed any channel's budget in any slot (with a
    /// shared SSD: the two directions' shares of a slot add up to at most all of it; with SSD
    /// transfers over the host link: the link carries the SSD's bytes too), and host memory
    /// never exceeds its cap.
    #[test]
    fn committed_bandwidth_stays_within_budget(
        trace in trace_strategy(),
        capacity_fraction in 0.3f64..1.0,
        host_mb in prop::sample::select(vec![0u64, 100, 1000]),
        ssd_gb_s in 0.5f64..30.0,
        ssd_shared in any::<bool>(),
        ssd_via_host_link in any::<bool>(),
        host_first in any::<bool>(),
    ) {
        let mut hardware = hardware_for(&trace, capacity_fraction, host_mb, ssd_gb_s);
        hardware.ssd_shared = ssd_shared;
        hardware.ssd_via_host_link = ssd_via_host_link;
        let tier_preference = if host_first { TierPreference::Host } else { TierPreference::Ssd };
        let config = PlannerConfig { tier_preference, ..PlannerConfig::default() };
        let mut outcome = plan_teraio(&trace, &hardware, config).unwrap();
        prop_assert!(outcome.ledger.worst_overcommit_bytes() <= 1e-3);
        if ssd_via_host_link {
            let ledger = &outcome.ledger;
            for channel in 0..2 {
                for slot in 0..ledger.budget_bytes[0].len() {
                    // Channels 0, 1: SSD write, read; 2, 3: host write, read.
                    prop_assert!(ledger.committed_bytes[channel + 2][slot] + 1e-3 >= ledger.committed_bytes[channel][slot]);
                }
            }
        }
        if ssd_shared {
            let ledger = &outcome.ledger;
            for slot in 0..ledger.budget_bytes[0].len() {
                let share: f64 = (0..2)
                    .filter(|&c| ledger.budget_bytes[c][slot] > 0.0)
                    .map(|c| ledger.committed_bytes[c][slot] / ledger.budget_bytes[c][slot])
                    .sum();
                prop_assert!(share <= 1.0 + 1e-6, "slot {} uses {} of its SSD time", slot, share);
            }
        }
        let held = outcome.ledger.host_held_bytes();
        prop_assert!(held.iter().all(|&h| h <= hardware.host_capacity_bytes));
    }

    /// The same inputs give the same plan.
    #[test]
    fn planning_is_deterministic(
        trace in trace_strategy(),
        capacity_fraction in 0.3f64..1.0,
        ssd_gb_s in 0.5f64..30.0,
    ) {
        let hardware = hardware_for(&trace, capacity_fraction, 100, ssd_gb_s);
        let first = plan_teraio(&trace, &hardware, PlannerConfig::default()).unwrap().plan;
        let second = plan_teraio(&trace, &hardware, PlannerConfig::default()).unwrap().plan;
        prop_assert_eq!(first, second);
    }

    /// Baselines and LRU, replayed by the same simulator, keep to capacity and residency too.
    #[test]
    fn baselines_keep_the_simulator_invariants(
        trace in trace_strategy(),
        capacity_fraction in 0.3f64..1.0,
        ssd_gb_s in 0.5f64..30.0,
    ) {
        let hardware = hardware_for(&trace, capacity_fraction, 100, ssd_gb_s);
        let zero = zero_infinity_like(&trace, &hardware);
        let flash = flashneuron_like(&trace, &hardware);
        for policy in [Policy::Planned(&zero), Policy::Planned(&flash), Policy::Lru] {
            let report = simulate(&trace, &hardware, policy, SimConfig::default()).unwrap();
            prop_assert!(report.peak_gpu_bytes <= hardware.gpu_capacity_bytes);
            prop_assert_eq!(report.residency_violations, 0);
        }
    }
}

/// On a shared SSD a read waits for a write in flight (and the reverse): replaying the same plan
/// takes longer than with independent channels when the two overlap, and moves the same bytes.
#[test]
fn a_shared_ssd_serves_one_direction_at_a_time() {
    let trace = generate(&model_preset("tiny").unwrap(), &gpu_preset("h100").unwrap()).unwrap();
    // SSD only, slow enough that the forward pass's writes run into the backward pass's reads.
    let mut hardware = hardware_for(&trace, 0.5, 0, 0.02);
    let plan = plan_teraio(&trace, &hardware, PlannerConfig::default()).unwrap().plan;
    assert!(!plan.migrations.is_empty());
    let apart = simulate(&trace, &hardware, Policy::Planned(&plan), SimConfig::default()).unwrap();
    hardware.ssd_shared = true;
    let shared = simulate(&trace, &hardware, Policy::Planned(&plan), SimConfig::default()).unwrap();
    assert_eq!(apart.outcome, Outcome::Completed);
    assert_eq!(shared.outcome, Outcome::Completed);
    assert!(
        shared.iteration_time_us > apart.iteration_time_us,
        "shared {} us vs apart {} us",
        shared.iteration_time_us,
        apart.iteration_time_us
    );
    assert_eq!(shared.ssd_written_bytes, apart.ssd_written_bytes);
    assert_eq!(shared.ssd_read_bytes, apart.ssd_read_bytes);
}

/// With SSD transfers over the host link, SSD traffic takes link time that host transfers
/// would otherwise have: the same plan replays slower when the link is the bottleneck, moving the
/// same bytes.
#[test]
fn ssd_transfers_over_the_host_link_take_its_time() {
    let trace = generate(&model_preset("tiny").unwrap(), &gpu_preset("h100").unwrap()).unwrap();
    // Both tiers in use, a link slower than the SSD so that the link is what binds.
    let mut hardware = hardware_for(&trace, 0.4, 20, 0.05);
    hardware.host_link_bytes_per_s = 0.02e9;
    let plan = plan_teraio(&trace, &hardware, PlannerConfig::default()).unwrap().plan;
    let tiers: std::collections::BTreeSet<String> = plan.migrations.iter().map(|m| format!("{:?}", m.tier)).collect();
    assert_eq!(tiers.len(), 2, "the plan should use both tiers: {tiers:?}");
    let apart = simulate(&trace, &hardware, Policy::Planned(&plan), SimConfig::default()).unwrap();
    hardware.ssd_via_host_link = true;
    let over_link = simulate(&trace, &hardware, Policy::Planned(&plan), SimConfig::default()).unwrap();
    assert_eq!(apart.outcome, Outcome::Completed);
    assert_eq!(over_link.outcome, Outcome::Completed);
    assert!(
        over_link.iteration_time_us > apart.iteration_time_us,
        "over the link {} us vs apart {} us",
        over_link.iteration_time_us,
        apart.iteration_time_us
    );
    for (a, b) in [
        (over_link.ssd_written_bytes, apart.ssd_written_bytes),
        (over_link.host_written_bytes, apart.host_written_bytes),
        (over_link.ssd_read_bytes, apart.ssd_read_bytes),
    ] {
        assert_eq!(a, b);
    }
}

/// `TierPreference::Auto` keeps whichever order the simulator predicts faster.
#[test]
fn auto_tier_preference_keeps_the_faster_order() {
    let trace = generate(&model_preset("tiny").unwrap(), &gpu_preset("h100").unwrap()).unwrap();
    let mut hardware = hardware_for(&trace, 0.4, 20, 0.05);
    hardware.host_link_bytes_per_s = 0.05e9;
    let predict = |tier_preference| {
        let config = PlannerConfig { tier_preference, ..PlannerConfig::default() };
        let plan = plan_teraio(&trace, &hardware, config).unwrap().plan;
        let report = simulate(&trace, &hardware, Policy::Planned(&plan), SimConfig::default()).unwrap();
        assert_eq!(report.outcome, Outcome::Completed);
        (plan, report.iteration_time_us)
    };
    let (ssd_plan, ssd_us) = predict(TierPreference::Ssd);
    let (host_plan, host_us) = predict(TierPreference::Host);
    let (auto_plan, auto_us) = predict(TierPreference::Auto);
    assert_ne!(ssd_plan, host_plan, "the two orders should differ on this trace");
    assert_eq!(auto_us, ssd_us.min(host_us));
    assert!(auto_plan == ssd_plan || auto_plan == host_plan);
}

/// The ideal replay takes exactly the sum of op times.
#[test]
fn unlimited_memory_has_no_stalls() {
    let trace = build_trace(vec![10.0, 20.0, 30.0, 40.0], vec![(0, 5, vec![0, 3], vec![]), (2, 7, vec![1, 2], vec![])]);
    let hardware = hardware_for(&trace, 10.0, 0, 1.0);
    let plan = plan_teraio(&trace, &hardware, PlannerConfig::default()).unwrap().plan;
    assert!(plan.migrations.is_empty());
    let report = simulate(&trace, &hardware, Policy::Planned(&plan), SimConfig::default()).unwrap();
    assert_eq!(report.outcome, Outcome::Completed);
    assert_eq!(report.iteration_time_us, 100.0);
    assert_eq!(report.stall_time_us, 0.0);
}
