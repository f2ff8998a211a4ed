//! The standard `process_*` metrics, read from `/proc` at scrape time as Prometheus's client
//! libraries do (on other systems they are absent).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

/// What one scrape reads about this process.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: f64,
    pub virtual_bytes: f64,
    pub start_time_seconds: f64,
    pub open_fds: f64,
    pub max_fds: f64,
}

/// Parses `/proc/self/stat` (fields after the parenthesised command name), given clock ticks
/// per second, the page size and the boot time from `/proc/stat`.
pub fn parse_stat(stat: &str, ticks: f64, page: f64, btime: f64) -> Option<ProcessStats> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state): field n is f[n - 3].
    let num = |n: usize| f.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    Some(ProcessStats {
        cpu_seconds: (num(14)? + num(15)?) / ticks,
        start_time_seconds: btime + num(22)? / ticks,
        virtual_bytes: num(23)?,
        resident_bytes: num(24)? * page,
        ..Default::default()
    })
}

/// The soft "Max open files" limit from `/proc/self/limits`.
pub fn parse_max_fds(limits: &str) -> Option<f64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line["Max open files".len()..].split_whitespace().next()?;
    soft.parse().ok()
}

fn read() -> Option<ProcessStats> {
    // SAFETY: sysconf only reads configuration values.
    let (ticks, page) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK) as f64,
            libc::sysconf(libc::_SC_PAGESIZE) as f64,
        )
    };
    let btime = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<f64>().ok())?;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let mut s = parse_stat(&stat, ticks.max(1.0), page.max(1.0), btime)?;
    s.open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as f64;
    s.max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| parse_max_fds(&l))
        .unwrap_or(0.0);
    Some(s)
}

#[derive(Debug, Default)]
pub struct ProcessCollector;

impl ProcessCollector {
    pub fn new() -> Self {
        ProcessCollector
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(s) = read() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            MetricType::Counter,
        )?)?;
        for (name, help, v) in [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                s.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                s.virtual_bytes,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                s.start_time_seconds,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                s.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                s.max_fds,
            ),
        ] {
            ConstGauge::new(v).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_stat_past_a_command_name_with_spaces() {
        // Fields 14, 15 (utime, stime) = 250, 150 ticks; 22 (starttime) = 1000 ticks;
        // 23 (vsize) = 8192 bytes; 24 (rss) = 3 pages.
        let mut fields = vec!["0"; 22];
        fields[14 - 3] = "250";
        fields[15 - 3] = "150";
        fields[22 - 3] = "1000";
        fields[23 - 3] = "8192";
        fields[24 - 3] = "3";
        let stat = format!("42 (a) b (c)) {}", fields.join(" "));
        let s = parse_stat(&stat, 100.0, 4096.0, 1_700_000_000.0).unwrap();
        assert_eq!(s.cpu_seconds, 4.0);
        assert_eq!(s.start_time_seconds, 1_700_000_010.0);
        assert_eq!(s.virtual_bytes, 8192.0);
        assert_eq!(s.resident_bytes, 12288.0);
    }

    #[test]
    fn parses_the_soft_fd_limit() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        assert_eq!(parse_max_fds(limits), Some(1024.0));
    }

    #[test]
    fn reads_this_process() {
        let s = read().expect("linux /proc");
        assert!(s.open_fds >= 1.0 && s.max_fds >= s.open_fds);
        assert!(s.resident_bytes > 0.0 && s.start_time_seconds > 1e9);
    }
}
