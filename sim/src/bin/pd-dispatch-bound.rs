//! The idealised prefill dispatch bound on synthetic mixed traces (see `pd_sim::dispatch_bound`).
fn main() -> std::process::ExitCode {
    pd_sim::dispatch_bound::bound_main()
}
