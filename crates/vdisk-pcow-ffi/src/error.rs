//! The last error of each thread, as C reads it, and the wrapper that keeps panics on the Rust
//! side.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static LAST: RefCell<Option<CString>> = const { RefCell::new(None) };
}

/// The message of the last call on this thread that failed, or NULL if none has. The string
/// belongs to the library and stays valid until the next `pcow_*` call on this thread.
#[no_mangle]
pub extern "C" fn pcow_last_error() -> *const c_char {
    LAST.with(|l| l.borrow().as_ref().map_or(std::ptr::null(), |s| s.as_ptr()))
}

pub(crate) fn set(message: String) {
    // A message with a NUL in it (a file name can hold none, but an error text might) is cut
    // there rather than lost.
    let bytes: Vec<u8> = message
        .into_bytes()
        .into_iter()
        .take_while(|&b| b != 0)
        .collect();
    let c = CString::new(bytes).unwrap_or_default();
    LAST.with(|l| *l.borrow_mut() = Some(c));
}

/// Runs `f`, turning its error into a negative errno and the thread's last error, and a panic
/// into -EIO: unwinding into C is undefined behaviour.
pub(crate) fn guard(what: &str, f: impl FnOnce() -> Result<(), vdisk::Error>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            set(e.to_string());
            -e.errno()
        }
        Err(panic) => {
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            set(format!("{what}: internal error (a panic): {why}"));
            -libc::EIO
        }
    }
}
