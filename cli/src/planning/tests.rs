//! The planner's command-line faces: argument parsing, the three commands end to end on a tiny
//! model.

use clap::{Parser, Subcommand};
use teraio_planner::greedy::TierPreference;
use teraio_planner::predict::{plan_and_predict, PlanOptions};
use teraio_planner::report::PolicyName;
use teraio_planner::synth::Dtype;
use teraio_planner::trace::Trace;

use super::{plan_command, sim_command, trace_command, PlanArgs, SimArgs, TraceArgs};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Plan(PlanArgs),
    Sim(SimArgs),
    Trace(TraceArgs),
}

fn parse(args: &[&str]) -> Result<Command, String> {
    Cli::try_parse_from(std::iter::once("teraio").chain(args.iter().copied()))
        .map(|cli| cli.command)
        .map_err(|e| e.to_string())
}

/// A file of this test run's, under the workspace's target directory (README: test files go
/// under target/).
fn temp_path(name: &str) -> std::path::PathBuf {
    let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-files");
    let dir = target.join(format!("teraio-planner-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn bad_sizes_and_bandwidths_are_refused_with_reasons() {
    let error = parse(&["plan", "t.json", "--gpu-mem", "40 gigs"]).err().unwrap();
    assert!(error.contains("unknown unit"), "{error}");
    let error = parse(&["plan", "t.json", "--ssd", "4x6.5GB"]).err().unwrap();
    assert!(error.contains("/s"), "{error}");
    let error = parse(&["sim", "t.json", "--host-mem=-1GiB"]).err().unwrap();
    assert!(error.contains("number"), "{error}");
    let Ok(Command::Plan(args)) =
        parse(&["plan", "t.json", "--gpu-mem", "40GiB", "--ssd", "4x6.5GB/s", "--host-mem", "64GiB"])
    else {
        panic!("good arguments refused");
    };
    assert_eq!(args.hardware.gpu_mem, Some(40 << 30));
    assert_eq!(args.hardware.ssd.read_bytes_per_s, 26e9);
    assert_eq!(args.hardware.host_mem, 64 << 30);
}

#[test]
fn trace_plan_and_sim_run_end_to_end() {
    let trace_path = temp_path("tiny.json");
    let trace_path_text = trace_path.to_str().unwrap();
    let Ok(Command::Trace(args)) =
        parse(&["trace", "--model", "tiny", "--batch", "8", "--seq", "512", "-o", trace_path_text])
    else {
        panic!("trace arguments refused");
    };
    let text = trace_command(&args).unwrap();
    assert!(text.contains("ops:"), "{text}");
    let trace = Trace::load(&trace_path).unwrap();
    let peak = teraio_planner::lifetime::base_pressure_bytes(&trace).into_iter().max().unwrap();
    // Three quarters of the unplanned peak: the plan must move tensors.
    let capacity = format!("{}", peak * 3 / 4);
    let plan_path = temp_path("plan.json");
    let svg_path = temp_path("memory.svg");
    let Ok(Command::Plan(args)) = parse(&[
        "plan",
        trace_path_text,
        "--gpu-mem",
        &capacity,
        "--ssd",
        "1x2GB/s",
        "--json",
        "-o",
        plan_path.to_str().unwrap(),
        "--svg",
        svg_path.to_str().unwrap(),
    ]) else {
        panic!("plan arguments refused");
    };
    let json = plan_command(&args).unwrap();
    let printed: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(printed["prediction"]["migrations"].as_u64().unwrap() > 0, "{json}");
    assert_eq!(printed["prediction"]["fits"], serde_json::Value::Bool(true), "{json}");
    // `--json` prints what the planner API returns (Python's `teraio.plan` returns it too), and
    // `-o` writes its plan.
    let hardware = args.hardware.hardware(&trace).unwrap();
    let direct = plan_and_predict(&trace, &hardware, &PlanOptions::default()).unwrap();
    let mut direct = serde_json::to_value(&direct).unwrap();
    let mut printed = printed;
    for value in [&mut direct, &mut printed] {
        value["prediction"]["planning_time_ms"] = serde_json::Value::Null;
    }
    assert_eq!(printed, direct);
    let saved: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan_path).unwrap()).unwrap();
    assert_eq!(saved, printed["plan"]);
    assert!(std::fs::read_to_string(&svg_path).unwrap().contains("<svg"));

    let Ok(Command::Sim(args)) = parse(&[
        "sim",
        trace_path_text,
        "--gpu-mem",
        &capacity,
        "--ssd",
        "1x2GB/s",
        "--policies",
        "ideal,teraio,lru",
        "--plan",
        plan_path.to_str().unwrap(),
    ]) else {
        panic!("sim arguments refused");
    };
    let (comparison, table) = sim_command(&args).unwrap();
    assert_eq!(comparison.rows.len(), 4, "{table}");
    assert!(table.contains("teraio") && table.contains("lru") && table.contains("plan:teraio"), "{table}");
    let ideal = &comparison.rows[0];
    assert!((ideal.percent_of_ideal - 100.0).abs() < 1e-6, "{table}");
    for row in &comparison.rows {
        assert!(row.percent_of_ideal <= 100.0 + 1e-9, "{table}");
    }
}

#[test]
fn named_values_parse_as_the_planner_spells_them() {
    let Ok(Command::Plan(args)) = parse(&["plan", "t.json", "--tier-preference", "host"]) else {
        panic!("--tier-preference host refused");
    };
    assert_eq!(args.planner.tier_preference, TierPreference::Host);
    let error = parse(&["plan", "t.json", "--tier-preference", "fastest"]).err().unwrap();
    assert!(error.contains("fastest") && error.contains("auto"), "{error}");
    let Ok(Command::Sim(args)) = parse(&["sim", "t.json", "--policies", "teraio-ssd,zero-infinity"]) else {
        panic!("--policies refused");
    };
    assert_eq!(args.policies, [PolicyName::TeraioSsd, PolicyName::ZeroInfinity]);
    let Ok(Command::Trace(args)) = parse(&["trace", "--dtype", "bf16", "-o", "t.json"]) else {
        panic!("--dtype bf16 refused");
    };
    assert_eq!(args.dtype, Some(Dtype::Bf16));
    assert!(parse(&["trace", "--dtype", "fp8", "-o", "t.json"]).is_err());
}
