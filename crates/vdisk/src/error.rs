//! Errors of the engine: one enum whose variants say what kind of failure it was, with a message
//! that names the step, the file and the offset. [`Error::errno`] maps a failure to the status
//! code the exports send (NBD, virtio-blk).

use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The host storage failed.
    #[error("{context}: {}", strerror(source))]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// The image breaks its format's rules; nothing is read or written past this point.
    #[error("{0}")]
    Corrupt(String),
    /// The image is valid but uses something vdisk does not implement.
    #[error("{0}")]
    Unsupported(String),
    /// The caller asked for something impossible (a request beyond the end of the disk).
    #[error("{0}")]
    InvalidArgument(String),
    /// A write to a read-only image.
    #[error("{0}: image is read-only")]
    ReadOnly(String),
}

/// An I/O error as C's `strerror` spells it ("No such file or directory"), which is what QEMU's
/// messages carry, without Rust's " (os error N)" suffix.
fn strerror(e: &io::Error) -> String {
    let text = e.to_string();
    match text.rfind(" (os error ") {
        Some(at) if e.raw_os_error().is_some() => text[..at].to_string(),
        _ => text,
    }
}

impl Error {
    /// The same error with `prefix` put before its message, to say which step it failed in.
    pub fn prefixed(self, prefix: &str) -> Self {
        match self {
            Error::Io { context, source } => Error::Io {
                context: format!("{prefix}{context}"),
                source,
            },
            Error::Corrupt(m) => Error::Corrupt(format!("{prefix}{m}")),
            Error::Unsupported(m) => Error::Unsupported(format!("{prefix}{m}")),
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("{prefix}{m}")),
            Error::ReadOnly(m) => Error::ReadOnly(format!("{prefix}{m}")),
        }
    }

    pub fn corrupt(msg: impl Into<String>) -> Self {
        Error::Corrupt(msg.into())
    }

    pub fn unsupported(msg: impl Into<String>) -> Self {
        Error::Unsupported(msg.into())
    }

    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    /// The POSIX error number that best describes this failure to a client.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::Corrupt(_) => libc::EIO,
            Error::Unsupported(_) => libc::ENOTSUP,
            Error::InvalidArgument(_) => libc::EINVAL,
            Error::ReadOnly(_) => libc::EPERM,
        }
    }
}

/// Adds the failed step to an `io::Error`.
pub trait IoContext<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Io {
            context: what(),
            source,
        })
    }
}
