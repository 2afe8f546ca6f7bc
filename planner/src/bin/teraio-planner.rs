//! Stand-alone front end for testing the planner; the `teraio` binary wires the same
//! `planner::cli` argument structs into `teraio plan|sim|trace`.

use clap::{Parser, Subcommand};
use teraio_planner::cli::{run_plan, run_sim, run_trace, PlanArgs, SimArgs, TraceArgs};

#[derive(Parser)]
#[command(name = "teraio-planner", about = "teraio lifetime planner and simulator")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Plan migrations for a trace and predict the iteration.
    Plan(PlanArgs),
    /// Replay a trace under each policy and compare.
    Sim(SimArgs),
    /// Generate a synthetic transformer-training trace.
    Trace(TraceArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Plan(args) => run_plan(args),
        Command::Sim(args) => run_sim(args),
        Command::Trace(args) => run_trace(args),
    };
    if let Err(error) = result {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}
