//! Runs several policies on one trace and hardware in the simulator and collects their results
//! (the CLI's `teraio sim` prints them as a table or JSON).

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::baselines::{flashneuron_like, unlimited, zero_infinity_like};
use crate::error::{Error, Result};
use crate::greedy::{plan_teraio, PlannerConfig};
use crate::hardware::Hardware;
use crate::plan::Plan;
use crate::sim::{simulate, Policy, SimConfig, SimReport};
use crate::trace::Trace;

/// Policies the comparison can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    /// Unlimited GPU memory.
    Ideal,
    /// This planner, SSD + host memory (TERAIO-Mixed when host memory is given).
    Teraio,
    /// This planner, SSD only (TERAIO-SSD).
    TeraioSsd,
    /// The paper's algorithm as published (no clean drop).
    TeraioPaper,
    /// ZeRO-Infinity-like.
    ZeroInfinity,
    /// FlashNeuron-like.
    Flashneuron,
    /// LRU swapping.
    Lru,
}

/// Default set for `sim`.
pub const ALL_POLICIES: [PolicyName; 7] = [
    PolicyName::Ideal,
    PolicyName::Teraio,
    PolicyName::TeraioSsd,
    PolicyName::TeraioPaper,
    PolicyName::ZeroInfinity,
    PolicyName::Flashneuron,
    PolicyName::Lru,
];

impl PolicyName {
    /// Name as printed.
    pub fn label(self) -> &'static str {
        match self {
            PolicyName::Ideal => "ideal",
            PolicyName::Teraio => "teraio",
            PolicyName::TeraioSsd => "teraio-ssd",
            PolicyName::TeraioPaper => "teraio-paper",
            PolicyName::ZeroInfinity => "zero-infinity",
            PolicyName::Flashneuron => "flashneuron",
            PolicyName::Lru => "lru",
        }
    }
}

impl std::str::FromStr for PolicyName {
    type Err = Error;
    fn from_str(text: &str) -> Result<Self> {
        ALL_POLICIES.iter().copied().find(|policy| policy.label() == text).ok_or_else(|| {
            let names: Vec<&str> = ALL_POLICIES.iter().map(|policy| policy.label()).collect();
            Error::Config(format!("unknown policy {text:?}; known: {}", names.join(", ")))
        })
    }
}

/// One policy's result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PolicyRow {
    /// Policy.
    pub policy: String,
    /// Planning time (0 for on-demand policies).
    pub planning_time_ms: f64,
    /// Migrations in the plan.
    pub migrations: usize,
    /// The planner's own fit estimate.
    pub plan_fits: bool,
    /// Throughput relative to ideal, percent (0 when out of memory).
    pub percent_of_ideal: f64,
    /// The simulator's measurements.
    pub sim: SimReport,
}

/// Results of all policies.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Comparison {
    /// The trace's description.
    pub trace: String,
    /// Hardware used.
    pub hardware: Hardware,
    /// Iteration time with unlimited memory.
    pub ideal_time_us: f64,
    /// One row per policy.
    pub rows: Vec<PolicyRow>,
}

/// Makes the plan of a planned policy; `None` for on-demand ones. Returns the plan and the
/// planning time.
pub fn make_plan(
    policy: PolicyName,
    trace: &Trace,
    hardware: &Hardware,
    config: PlannerConfig,
) -> Result<Option<(Plan, f64)>> {
    let started = Instant::now();
    let plan = match policy {
        PolicyName::Ideal => Some(Plan::empty("ideal", trace, u64::MAX / 4, 0)),
        PolicyName::Teraio => Some(plan_teraio(trace, hardware, config)?.plan),
        PolicyName::TeraioSsd => {
            let ssd_only = Hardware { host_capacity_bytes: 0, ..*hardware };
            let mut plan = plan_teraio(trace, &ssd_only, config)?.plan;
            plan.policy = "teraio-ssd".into();
            Some(plan)
        }
        PolicyName::TeraioPaper => Some(plan_teraio(trace, hardware, config.paper())?.plan),
        PolicyName::ZeroInfinity => Some(zero_infinity_like(trace, hardware)),
        PolicyName::Flashneuron => Some(flashneuron_like(trace, hardware)),
        PolicyName::Lru => None,
    };
    Ok(plan.map(|p| (p, started.elapsed().as_secs_f64() * 1e3)))
}

/// Simulates one policy.
pub fn run_policy(
    policy: PolicyName,
    trace: &Trace,
    hardware: &Hardware,
    config: PlannerConfig,
    ideal_time_us: f64,
) -> Result<PolicyRow> {
    let planned = make_plan(policy, trace, hardware, config)?;
    let sim_hardware = if policy == PolicyName::Ideal { unlimited(hardware) } else { *hardware };
    let (sim, planning_time_ms, migrations, plan_fits) = match &planned {
        Some((plan, ms)) => (
            simulate(trace, &sim_hardware, Policy::Planned(plan), SimConfig::default())?,
            *ms,
            plan.migrations.len(),
            plan.fits,
        ),
        None => (simulate(trace, &sim_hardware, Policy::Lru, SimConfig::default())?, 0.0, 0, true),
    };
    let mut sim = sim;
    sim.policy = policy.label().to_string();
    Ok(PolicyRow {
        policy: policy.label().to_string(),
        planning_time_ms,
        migrations,
        plan_fits,
        percent_of_ideal: sim.percent_of(ideal_time_us),
        sim,
    })
}

/// Runs the given policies.
pub fn compare(
    trace: &Trace,
    hardware: &Hardware,
    config: PlannerConfig,
    policies: &[PolicyName],
) -> Result<Comparison> {
    let ideal_time_us = trace.compute_time_us();
    let mut rows = Vec::new();
    for &policy in policies {
        rows.push(run_policy(policy, trace, hardware, config, ideal_time_us)?);
    }
    Ok(Comparison { trace: trace.description.clone(), hardware: *hardware, ideal_time_us, rows })
}
