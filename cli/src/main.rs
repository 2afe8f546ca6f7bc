//! `teraio`: the command-line face of teraio. It benchmarks SSD arrays the way the engine uses
//! them (`bench`, with a side-by-side fio comparison), administers stores (`format`, `info`,
//! `fsck`) and fronts the lifetime planner (`plan`, `sim`, `trace`).
//!
//! Every failure ends in one line on stderr that says what to do, and a non-zero exit code:
//! 1 for a failed operation (or an unclean `fsck`), 2 for bad input.

mod admin;
mod bench;
mod cpu;
mod error;
mod planning;
mod targets;
mod units;

use clap::{Parser, Subcommand};

/// teraio: striped tensor-offload storage over many SSDs.
#[derive(Parser)]
#[command(name = "teraio", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure what a set of SSDs (files or block devices, striped as a teraio store) delivers.
    Bench(bench::BenchArgs),
    /// Format files or block devices as one new teraio store.
    Format(admin::FormatArgs),
    /// Show a store's devices, layout, free space and objects.
    Info(admin::InfoArgs),
    /// Check a store: superblocks, the object table and every extent checksum.
    Fsck(admin::FsckArgs),
    /// Plan tensor migrations for a training trace and predict the iteration time.
    Plan(planning::PlanArgs),
    /// Replay a trace under each offload policy and compare.
    Sim(planning::SimArgs),
    /// Generate a synthetic transformer-training trace.
    Trace(planning::TraceArgs),
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => exit_on_parse_error(e),
    };
    let result = match &cli.command {
        Command::Bench(args) => bench::run(args),
        Command::Format(args) => admin::format(args),
        Command::Info(args) => admin::info(args),
        Command::Fsck(args) => admin::fsck(args),
        Command::Plan(args) => planning::run_plan(args),
        Command::Sim(args) => planning::run_sim(args),
        Command::Trace(args) => planning::run_trace(args),
    };
    if let Err(e) = result {
        eprintln!("error: {}", e.message);
        std::process::exit(e.exit_code);
    }
}

/// Help and version go to stdout as clap writes them; every other parse error becomes one line
/// (clap's first line, which names the bad flag or value) plus where to look, and exit code 2.
fn exit_on_parse_error(e: clap::Error) -> ! {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion)
        || e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    {
        e.exit();
    }
    let rendered = e.render().to_string();
    let first = rendered.lines().find(|l| !l.trim().is_empty()).unwrap_or("error: bad arguments");
    let mut first = first.trim_start_matches("error: ").trim_end_matches(':').to_string();
    // clap puts the missing arguments' names on the lines after the first: keep them.
    if e.kind() == ErrorKind::MissingRequiredArgument {
        if let Some(ContextValue::Strings(missing)) = e.get(ContextKind::InvalidArg) {
            first = format!("{first}: {}", missing.join(", "));
        }
    }
    let sub = std::env::args().nth(1).filter(|a| !a.starts_with('-'));
    let help = match sub {
        Some(s) if e.kind() != ErrorKind::InvalidSubcommand => format!("teraio {s} --help"),
        _ => "teraio --help".to_string(),
    };
    eprintln!("error: {first}; see `{help}`");
    std::process::exit(2);
}
