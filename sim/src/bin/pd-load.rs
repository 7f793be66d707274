//! Open-loop load generator; see `pd_sim::cli::LoadArgs`.
fn main() -> std::process::ExitCode {
    pd_sim::cli::load_main()
}
