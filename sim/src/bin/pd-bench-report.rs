//! Tables and SVG charts of `make bench` results (see `pd_sim::report`).
fn main() -> std::process::ExitCode {
    pd_sim::report::report_main()
}
