//! The exports' log: lines with a level, filtered before they are formatted, written to a sink
//! the caller chooses (stderr for `vdisk serve`, a collector in tests).
//!
//! The levels follow what qemu-nbd prints. By default (`warn`) a log shows what needs
//! attention: the server's own failures, disk errors, and clients that broke the protocol or
//! whose connection failed. `info` adds every connection coming and going; `debug` adds the
//! negotiation, refused requests and connections parked while idle.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

/// How much the server says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// The server's own failures (accepting, starting threads, the I/O queue).
    Error,
    /// Disk errors, protocol violations, connections that ended with an error.
    Warn,
    /// Connections opened and closed, exports chosen, handshakes timed out.
    Info,
    /// Options negotiated, requests refused, idle connections parked and resumed.
    Debug,
}

/// The variable that sets the level when the command line does not.
pub const LEVEL_VAR: &str = "VDISK_LOG";

impl Level {
    /// `error`, `warn` (or `warning`), `info`, `debug` (or `trace`), in any case.
    pub fn parse(s: &str) -> Result<Level, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "error" => Ok(Level::Error),
            "warn" | "warning" => Ok(Level::Warn),
            "info" => Ok(Level::Info),
            "debug" | "trace" => Ok(Level::Debug),
            _ => Err(format!(
                "invalid log level '{s}' (expected error, warn, info or debug)"
            )),
        }
    }

    /// The level [`LEVEL_VAR`] names, if it is set. Like `RUST_LOG`, a list of directives is
    /// accepted and the last bare level or `vdisk=LEVEL` in it wins (`VDISK_LOG=info`,
    /// `VDISK_LOG=warn,vdisk=debug`).
    pub fn from_env() -> Option<Result<Level, String>> {
        let v = std::env::var(LEVEL_VAR).ok()?;
        Level::from_directives(&v).map(|r| r.map_err(|e| format!("{LEVEL_VAR}: {e}")))
    }

    fn from_directives(v: &str) -> Option<Result<Level, String>> {
        let mut found = None;
        for d in v.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            let level = match d.split_once('=') {
                Some((target, level)) if target.trim() == "vdisk" => level,
                Some(_) => continue,
                None => d,
            };
            found = Some(Level::parse(level));
        }
        found
    }

    pub fn name(self) -> &'static str {
        match self {
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
        }
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where log lines go: the level and the line (without a trailing newline).
pub type Log = Arc<dyn Fn(Level, &str) + Send + Sync>;

/// Writes `PROGRAM: LEVEL: LINE` to stderr; `program` is the name the user ran.
pub fn stderr_sink(program: &'static str) -> Log {
    Arc::new(move |level: Level, line: &str| eprintln!("{program}: {level}: {line}"))
}

/// A sink and the most detailed level it takes.
#[derive(Clone)]
pub struct Logger {
    level: Level,
    sink: Log,
}

impl Logger {
    pub fn new(level: Level, sink: Log) -> Logger {
        Logger { level, sink }
    }

    pub fn enabled(&self, level: Level) -> bool {
        level <= self.level
    }

    /// Formats and writes the line only when `level` is enabled.
    pub fn log(&self, level: Level, args: fmt::Arguments<'_>) {
        if self.enabled(level) {
            match args.as_str() {
                Some(s) => (self.sink)(level, s),
                None => (self.sink)(level, &args.to_string()),
            }
        }
    }
}

impl Default for Logger {
    fn default() -> Logger {
        Logger::new(Level::Warn, stderr_sink("vdisk"))
    }
}

impl fmt::Debug for Logger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Logger({})", self.level)
    }
}

/// `log!(logger, Level::Info, "format", args...)`.
macro_rules! log {
    ($logger:expr, $level:expr, $($arg:tt)+) => {
        $logger.log($level, format_args!($($arg)+))
    };
}
pub(crate) use log;

/// At most one line a second from a source that can repeat without bound (a disk failing every
/// request, a full host file system); the lines held back are counted in the next one.
#[derive(Default)]
pub(crate) struct Throttle {
    /// Milliseconds since `epoch` of the last line written, plus one (0: none yet).
    last: AtomicU64,
    held: AtomicU64,
}

impl Throttle {
    /// `Some(lines held back since the last one)` when a line may be written now.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(epoch().elapsed().as_millis() as u64 + 1)
    }

    fn admit_at(&self, now: u64) -> Option<u64> {
        let last = self.last.load(Relaxed);
        if last != 0 && now < last + 1000 {
            self.held.fetch_add(1, Relaxed);
            return None;
        }
        if self
            .last
            .compare_exchange(last, now, Relaxed, Relaxed)
            .is_err()
        {
            self.held.fetch_add(1, Relaxed);
            return None;
        }
        Some(self.held.swap(0, Relaxed))
    }
}

fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn levels_parse_and_order() {
        assert_eq!(Level::parse("WARNING"), Ok(Level::Warn));
        assert_eq!(Level::parse(" debug "), Ok(Level::Debug));
        assert!(Level::parse("loud").is_err());
        assert!(Level::Error < Level::Warn && Level::Info < Level::Debug);
        assert_eq!(Level::from_directives("info"), Some(Ok(Level::Info)));
        assert_eq!(
            Level::from_directives("warn, other=debug ,vdisk=debug"),
            Some(Ok(Level::Debug))
        );
        assert_eq!(Level::from_directives("other=debug"), None);
        assert!(matches!(Level::from_directives("vdisk=loud"), Some(Err(_))));
    }

    #[test]
    fn lines_below_the_level_are_not_formatted() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let sink = got.clone();
        let logger = Logger::new(
            Level::Info,
            Arc::new(move |l: Level, s: &str| sink.lock().unwrap().push(format!("{l} {s}"))),
        );
        struct Panics;
        impl fmt::Display for Panics {
            fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
                panic!("formatted a line that is filtered out")
            }
        }
        log!(logger, Level::Debug, "{}", Panics);
        log!(logger, Level::Info, "a {}", 1);
        log!(logger, Level::Error, "b");
        assert_eq!(*got.lock().unwrap(), vec!["info a 1", "error b"]);
    }

    #[test]
    fn throttle_lets_one_line_a_second_through() {
        let t = Throttle::default();
        assert_eq!(t.admit_at(5), Some(0));
        assert_eq!(t.admit_at(6), None);
        assert_eq!(t.admit_at(1004), None);
        assert_eq!(t.admit_at(1005), Some(2));
        assert_eq!(t.admit_at(1006), None);
    }
}
