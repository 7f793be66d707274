//! Scale benchmark for pd-control's scraping: generates an N-pod fleet (prefill+decode
//! rolesets on 127.2.x.y), starts pd-sim and pd-control as children, samples pd-control's
//! snapshot and metrics once a second over a bounded window, and reports CPU (from
//! /proc/<pid>/stat), RSS, scrape freshness, errors and round duration as a table and JSON.
//! Children are killed on every exit path (Drop guard, Ctrl-C/SIGTERM, PR_SET_PDEATHSIG).

use std::io::{BufRead, BufReader, Write as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use serde_json::{json, Value};

#[derive(Debug, Parser)]
#[command(name = "pd-bench-scrape", about = "pd-control scrape scale benchmark")]
struct Args {
    /// Pods in the generated fleet (even: prefill+decode rolesets).
    #[arg(long, default_value_t = 1000)]
    pods: usize,
    /// Measured window in seconds (default: $BENCH_SECONDS, else 30).
    #[arg(long)]
    seconds: Option<u64>,
    /// Seconds to run after pd-control is ready before measuring.
    #[arg(long, default_value_t = 3)]
    warmup: u64,
    /// pd-control --refresh-interval.
    #[arg(long, default_value = "100ms")]
    interval: String,
    /// Port every pod listens on.
    #[arg(long, default_value_t = 18000)]
    port: u16,
    /// Directory holding pd-sim and pd-control (default: this binary's directory).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Where to write the JSON report.
    #[arg(long, default_value = "bench-scrape.json")]
    out: PathBuf,
    /// Extra argument for pd-control (repeatable), e.g. --control-arg=--scrape-concurrency=256.
    #[arg(long, allow_hyphen_values = true)]
    control_arg: Vec<String>,
}

/// Kills and reaps the children when dropped, so errors and early returns leave nothing behind.
#[derive(Default)]
struct Children(Vec<(&'static str, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (name, child) in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
            eprintln!("pd-bench-scrape: stopped {name} (pid {})", child.id());
        }
    }
}

fn fleet_yaml(pods: usize, port: u16) -> String {
    let mut s = String::from("apiVersion: v1\nkind: List\nitems:\n");
    for i in 0..pods {
        let (role, rs) = (if i % 2 == 0 { "prefill" } else { "decode" }, i / 2);
        s += &format!(
            "- apiVersion: v1\n  kind: Pod\n  metadata:\n    name: scale-{role}-{rs}\n    namespace: scale\n    \
             labels: {{model.aibrix.ai/name: scale-model, model.aibrix.ai/port: \"{port}\", \
             model.aibrix.ai/engine: vllm, role-name: {role}, roleset-name: rs-{rs}}}\n    \
             annotations: {{model.aibrix.ai/config: '{{\"profiles\": {{\"default\": {{\"routingStrategy\": \"pd\"}}}}}}'}}\n  \
             status:\n    podIP: 127.2.{}.{}\n    conditions: [{{type: Ready, status: \"True\"}}]\n",
            i / 250,
            i % 250 + 1
        );
    }
    s
}

/// Makes sure this process (and so its children) may open `need` descriptors.
fn raise_nofile(need: u64) -> Result<u64, String> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read/write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return Err("getrlimit failed".into());
        }
        if lim.rlim_cur >= need {
            return Ok(lim.rlim_cur);
        }
        if lim.rlim_max < need {
            return Err(format!(
                "RLIMIT_NOFILE hard limit {} < {need} needed; raise it (ulimit -Hn / limits.conf)",
                lim.rlim_max
            ));
        }
        lim.rlim_cur = lim.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
            return Err("setrlimit failed".into());
        }
    }
    Ok(lim.rlim_cur)
}

/// Spawns `bin`, logging stderr to `log`, and waits (bounded) for a stdout line starting with
/// `prefix`; returns the rest of that line. stdout keeps being drained by a thread.
fn spawn_until(
    children: &mut Children,
    name: &'static str,
    mut cmd: Command,
    log: &Path,
    prefix: &'static str,
    timeout: Duration,
) -> Result<(u32, String), String> {
    let log = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    cmd.stdout(Stdio::piped()).stderr(log).stdin(Stdio::null());
    // SAFETY: prctl is async-signal-safe; the child dies if the benchmark dies.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {name}: {e}"))?;
    let pid = child.id();
    let stdout = child.stdout.take().expect("piped");
    children.0.push((name, child));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix(prefix) {
                let _ = tx.send(rest.trim().to_string());
            }
        }
    });
    let rest = rx
        .recv_timeout(timeout)
        .map_err(|_| format!("{name} did not print {prefix:?} within {timeout:?}"))?;
    Ok((pid, rest))
}

/// (user+sys CPU seconds, threads) of a process.
fn cpu_of(pid: u32, tick: f64) -> Option<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let (u, s): (f64, f64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
    Some(((u + s) / tick, f.get(17)?.parse().ok()?))
}

/// A `/proc/<pid>/status` field in KiB (VmRSS, VmHWM).
fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn fds_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn prom_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[derive(Default)]
struct Samples {
    ages_ms: Vec<f64>,
    stale: Vec<f64>,
    pods_seen: Vec<f64>,
    durations_s: Vec<f64>,
    fetch_ms: Vec<f64>,
    rss_kib: Vec<f64>,
    failed: usize,
}

async fn sample(http: &reqwest::Client, base: &str, pid: u32, s: &mut Samples) {
    let t0 = Instant::now();
    let snap = async {
        let body = http
            .get(format!("{base}/v1/snapshot.json"))
            .send()
            .await?
            .bytes()
            .await?;
        Ok::<_, reqwest::Error>(body)
    }
    .await;
    let now = unix_ms();
    s.fetch_ms.push(t0.elapsed().as_secs_f64() * 1e3);
    match snap
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
    {
        Some(v) => {
            let (mut seen, mut stale) = (0, 0);
            for model in v["models"].as_array().into_iter().flatten() {
                for pod in model["pods"].as_array().into_iter().flatten() {
                    seen += 1;
                    let m = &pod["metrics"];
                    if m["stale"].as_bool().unwrap_or(true)
                        || !m["present"].as_bool().unwrap_or(false)
                    {
                        stale += 1;
                    }
                    if let Some(last) = m["last_scrape_unix_ms"].as_i64().filter(|&t| t > 0) {
                        s.ages_ms.push((now - last).max(0) as f64);
                    }
                }
            }
            s.pods_seen.push(seen as f64);
            s.stale.push(stale as f64);
        }
        None => s.failed += 1,
    }
    if let Ok(r) = http.get(format!("{base}/metrics")).send().await {
        if let Some(d) = r
            .text()
            .await
            .ok()
            .and_then(|t| prom_value(&t, "pd_control_scrape_duration_seconds"))
        {
            s.durations_s.push(d);
        }
    }
    if let Some(rss) = status_kib(pid, "VmRSS:") {
        s.rss_kib.push(rss as f64);
    }
}

async fn prom(http: &reqwest::Client, base: &str, name: &str) -> Option<f64> {
    let text = http.get(format!("{base}/metrics")).send().await.ok()?;
    prom_value(&text.text().await.ok()?, name)
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

async fn run(args: Args, children: &mut Children) -> Result<(), String> {
    let seconds = args.seconds.unwrap_or_else(|| {
        std::env::var("BENCH_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(30)
    });
    let bin_dir = match args.bin_dir.clone() {
        Some(d) => d,
        None => std::env::current_exe()
            .map_err(|e| e.to_string())?
            .parent()
            .ok_or("no binary directory")?
            .to_path_buf(),
    };
    // pd-sim: one listener + one accepted connection per pod; pd-control: one per pod.
    let need = 2 * args.pods as u64 + 1024;
    let nofile = raise_nofile(need)?;
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let work = std::env::temp_dir().join(format!("pd-bench-scrape-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let fleet = work.join("fleet.yaml");
    std::fs::write(&fleet, fleet_yaml(args.pods, args.port)).map_err(|e| e.to_string())?;
    eprintln!(
        "pd-bench-scrape: {} pods, fleet {}, RLIMIT_NOFILE {nofile}, logs in {}",
        args.pods,
        fleet.display(),
        work.display()
    );

    let mut sim = Command::new(bin_dir.join("pd-sim"));
    sim.arg("--fleet").arg(&fleet);
    let started = Instant::now();
    let (sim_pid, serving) = spawn_until(
        children,
        "pd-sim",
        sim,
        &work.join("pd-sim.log"),
        "pd-sim: serving ",
        Duration::from_secs(60),
    )?;
    eprintln!(
        "pd-bench-scrape: pd-sim serving {serving} after {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let mut ctl = Command::new(bin_dir.join("pd-control"));
    ctl.arg("--fleet")
        .arg(&fleet)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--refresh-interval",
            &args.interval,
        ])
        .args(&args.control_arg);
    let (ctl_pid, addr) = spawn_until(
        children,
        "pd-control",
        ctl,
        &work.join("pd-control.log"),
        "pd-control: listening on ",
        Duration::from_secs(30),
    )?;
    let base = format!("http://{addr}");
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| e.to_string())?;
    let ready_by = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = http.get(format!("{base}/readyz")).send().await {
            if r.status().is_success() {
                break;
            }
        }
        if Instant::now() > ready_by {
            return Err("pd-control not ready within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "pd-bench-scrape: pd-control ready on {addr}; warm-up {} s, measuring {seconds} s",
        args.warmup
    );
    tokio::time::sleep(Duration::from_secs(args.warmup)).await;

    let errors0 = prom(&http, &base, "pd_control_scrape_errors_total")
        .await
        .unwrap_or(0.0);
    let me = std::process::id();
    let cpu0 = [ctl_pid, sim_pid, me].map(|p| cpu_of(p, tick).map_or(0.0, |c| c.0));
    let t0 = Instant::now();
    let mut s = Samples::default();
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.tick().await;
    for _ in 0..seconds {
        ticker.tick().await;
        sample(&http, &base, ctl_pid, &mut s).await;
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu1 = [ctl_pid, sim_pid, me].map(|p| cpu_of(p, tick).map_or(0.0, |c| c.0));
    let errors1 = prom(&http, &base, "pd_control_scrape_errors_total")
        .await
        .unwrap_or(f64::NAN);
    let pct_core = |i: usize| 100.0 * (cpu1[i] - cpu0[i]) / wall;
    let threads = |p| cpu_of(p, tick).map_or(0, |c| c.1);
    let (ctl_hwm, sim_rss) = (
        status_kib(ctl_pid, "VmHWM:").unwrap_or(0),
        status_kib(sim_pid, "VmRSS:").unwrap_or(0),
    );
    let (ctl_fds, sim_fds) = (fds_of(ctl_pid), fds_of(sim_pid));
    let ages = sorted(std::mem::take(&mut s.ages_ms));
    let stale = sorted(s.stale.clone());
    let durs = sorted(s.durations_s.clone());
    let fetch = sorted(s.fetch_ms.clone());
    let rss = sorted(s.rss_kib.clone());
    let interval_ms = humantime_ms(&args.interval);
    let report = json!({
        "pods": args.pods,
        "refresh_interval": args.interval,
        "window_s": wall,
        "samples": s.pods_seen.len(),
        "sample_failures": s.failed,
        "pods_in_snapshot_min": s.pods_seen.iter().cloned().fold(f64::INFINITY, f64::min),
        "pd_control": {
            "cpu_seconds": cpu1[0] - cpu0[0],
            "cpu_pct_of_one_core": pct_core(0),
            "rss_mib_median": pct(&rss, 0.5) / 1024.0,
            "rss_mib_max": pct(&rss, 1.0) / 1024.0,
            "rss_hwm_mib": ctl_hwm as f64 / 1024.0,
            "threads": threads(ctl_pid),
            "open_fds": ctl_fds,
            "extra_args": args.control_arg,
        },
        "pd_sim": {
            "cpu_seconds": cpu1[1] - cpu0[1],
            "cpu_pct_of_one_core": pct_core(1),
            "rss_mib": sim_rss as f64 / 1024.0,
            "threads": threads(sim_pid),
            "open_fds": sim_fds,
        },
        "sampler_cpu_pct_of_one_core": pct_core(2),
        "freshness_ms": {
            "p50": pct(&ages, 0.5), "p99": pct(&ages, 0.99), "max": pct(&ages, 1.0),
            "count": ages.len(),
            "over_interval_pct": 100.0 * ages.iter().filter(|&&a| a > interval_ms).count() as f64 / ages.len().max(1) as f64,
        },
        "stale_pods": { "median": pct(&stale, 0.5), "max": pct(&stale, 1.0) },
        "scrape_errors_in_window": errors1 - errors0,
        "scrape_round_duration_ms": {
            "p50": pct(&durs, 0.5) * 1e3, "max": pct(&durs, 1.0) * 1e3,
        },
        "snapshot_json_fetch_ms": { "p50": pct(&fetch, 0.5), "max": pct(&fetch, 1.0) },
    });
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let r = &report;
    let mut out = String::new();
    use std::fmt::Write as _;
    let _ = writeln!(
        out,
        "\npd-bench-scrape: {} pods, refresh {}, {:.1} s window, {} samples\n",
        args.pods,
        args.interval,
        wall,
        s.pods_seen.len()
    );
    let rows = [
        (
            "pd-control CPU (% of one core)",
            format!("{:.1} %", f(&r["pd_control"]["cpu_pct_of_one_core"])),
        ),
        (
            "pd-control RSS median / max / HWM",
            format!(
                "{:.1} / {:.1} / {:.1} MiB",
                f(&r["pd_control"]["rss_mib_median"]),
                f(&r["pd_control"]["rss_mib_max"]),
                f(&r["pd_control"]["rss_hwm_mib"])
            ),
        ),
        (
            "pd-control threads / fds",
            format!("{} / {}", threads(ctl_pid), ctl_fds),
        ),
        (
            "pd-sim CPU (% of one core)",
            format!("{:.1} %", f(&r["pd_sim"]["cpu_pct_of_one_core"])),
        ),
        (
            "pd-sim RSS / threads / fds",
            format!(
                "{:.1} MiB / {} / {}",
                f(&r["pd_sim"]["rss_mib"]),
                threads(sim_pid),
                sim_fds
            ),
        ),
        (
            "sampler CPU (this process)",
            format!("{:.1} %", f(&r["sampler_cpu_pct_of_one_core"])),
        ),
        (
            "metrics age p50 / p99 / max",
            format!(
                "{:.0} / {:.0} / {:.0} ms",
                f(&r["freshness_ms"]["p50"]),
                f(&r["freshness_ms"]["p99"]),
                f(&r["freshness_ms"]["max"])
            ),
        ),
        (
            "ages over one interval",
            format!("{:.1} %", f(&r["freshness_ms"]["over_interval_pct"])),
        ),
        (
            "stale pods median / max",
            format!(
                "{:.0} / {:.0}",
                f(&r["stale_pods"]["median"]),
                f(&r["stale_pods"]["max"])
            ),
        ),
        (
            "scrape errors in window",
            format!("{:.0}", f(&r["scrape_errors_in_window"])),
        ),
        (
            "scrape round duration p50 / max",
            format!(
                "{:.1} / {:.1} ms",
                f(&r["scrape_round_duration_ms"]["p50"]),
                f(&r["scrape_round_duration_ms"]["max"])
            ),
        ),
        (
            "snapshot.json fetch p50 / max",
            format!(
                "{:.1} / {:.1} ms",
                f(&r["snapshot_json_fetch_ms"]["p50"]),
                f(&r["snapshot_json_fetch_ms"]["max"])
            ),
        ),
    ];
    for (k, v) in rows {
        let _ = writeln!(out, "  {k:<36} {v}");
    }
    print!("{out}");
    let _ = std::io::stdout().flush();
    std::fs::write(
        &args.out,
        serde_json::to_string_pretty(&report).unwrap_or_default() + "\n",
    )
    .map_err(|e| format!("{}: {e}", args.out.display()))?;
    eprintln!("pd-bench-scrape: wrote {}", args.out.display());
    Ok(())
}

/// "100ms" / "1s" / "250us" → milliseconds (the refresh interval, for the over-interval share).
fn humantime_ms(s: &str) -> f64 {
    let s = s.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let n: f64 = s[..split].parse().unwrap_or(f64::NAN);
    match &s[split..] {
        "us" => n / 1e3,
        "s" => n * 1e3,
        "m" => n * 60e3,
        _ => n,
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pd-bench-scrape: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut children = Children::default();
    let result = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| e.to_string())?;
        tokio::select! {
            r = run(args, &mut children) => r,
            _ = tokio::signal::ctrl_c() => Err("interrupted".to_string()),
            _ = term.recv() => Err("terminated".to_string()),
        }
    });
    drop(children);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pd-bench-scrape: {e}");
            ExitCode::FAILURE
        }
    }
}
