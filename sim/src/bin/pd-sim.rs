//! Simulated vLLM pods for a fleet file; see `pd_sim::cli::SimArgs`.
fn main() -> std::process::ExitCode {
    pd_sim::cli::sim_main()
}
