//! A connection to a Ceph cluster and a pool in it, made as QEMU's `qemu_rbd_connect` makes
//! it, with its messages: the configuration file named (else Ceph's default search, which
//! reads `CEPH_CONF`), then the name's `key=value` options, then the cache setting.

use std::ffi::{c_int, CString};
use std::ptr;

use super::ffi::{self, check, Handle, Lib};
use super::RbdTarget;
use crate::error::{Error, Result};

/// A cluster handle and an I/O context on the target's pool; both released on drop.
pub struct Cluster {
    pub lib: &'static Lib,
    rados: Handle,
    pub ioctx: Handle,
}

// SAFETY: librados handles may be used from any thread (QEMU completes requests on librbd's
// threads); the handles are only released in `drop`, which has `&mut self`.
unsafe impl Send for Cluster {}
// SAFETY: as above: librados and librbd lock internally.
unsafe impl Sync for Cluster {}

/// `text` as a C string; Ceph names cannot hold a NUL.
pub fn c_string(text: &str) -> Result<CString> {
    CString::new(text).map_err(|_| Error::invalid(format!("'{text}' holds a NUL byte")))
}

/// An `Error::Io` for a negative return `r` of a librados/librbd call.
pub fn failed(context: impl Into<String>, r: c_int) -> Error {
    Error::Io {
        context: context.into(),
        source: check(r)
            .err()
            .unwrap_or_else(|| std::io::Error::other("failed")),
    }
}

impl Cluster {
    /// Connects to the cluster `t` names and opens its pool (and namespace). `cache` turns on
    /// librbd's write-back cache, as QEMU does unless the image is opened with
    /// `cache.direct=on`.
    pub fn connect(t: &RbdTarget, cache: bool) -> Result<Cluster> {
        let lib = ffi::lib().map_err(|e| Error::unsupported(e.to_string()))?;
        let user = t.user.as_deref().map(c_string).transpose()?;
        let mut rados: Handle = ptr::null_mut();
        let user_ptr = user.as_ref().map_or(ptr::null(), |u| u.as_ptr());
        // SAFETY: `rados` receives the new handle; the id is NULL or a C string.
        let r = unsafe { (lib.rados_create)(&mut rados, user_ptr) };
        if r < 0 {
            return Err(failed("error initializing", r));
        }
        // From here on, drop shuts the handle down.
        let mut cluster = Cluster {
            lib,
            rados,
            ioctx: ptr::null_mut(),
        };
        cluster.configure(t, cache)?;
        // SAFETY: a configured handle, not yet connected.
        let r = unsafe { (lib.rados_connect)(cluster.rados) };
        if r < 0 {
            return Err(failed("error connecting", r));
        }
        let pool = c_string(&t.pool)?;
        let mut ioctx: Handle = ptr::null_mut();
        // SAFETY: a connected handle, a C string, and a place for the new context.
        let r = unsafe { (lib.rados_ioctx_create)(cluster.rados, pool.as_ptr(), &mut ioctx) };
        if r < 0 {
            return Err(failed(format!("error opening pool {}", t.pool), r));
        }
        cluster.ioctx = ioctx;
        let namespace = c_string(t.namespace.as_deref().unwrap_or(""))?;
        // SAFETY: a live context; the empty namespace is the default one.
        unsafe { (lib.rados_ioctx_set_namespace)(ioctx, namespace.as_ptr()) };
        Ok(cluster)
    }

    fn configure(&mut self, t: &RbdTarget, cache: bool) -> Result<()> {
        let conf = t.conf.as_deref().map(c_string).transpose()?;
        let conf_ptr = conf.as_ref().map_or(ptr::null(), |c| c.as_ptr());
        // SAFETY: an unconnected handle; NULL reads Ceph's default files (and CEPH_CONF).
        let r = unsafe { (self.lib.rados_conf_read_file)(self.rados, conf_ptr) };
        // As QEMU: without a file named, a missing default file is not an error.
        if let (Some(path), true) = (&t.conf, r < 0) {
            return Err(failed(format!("error reading conf file {path}"), r));
        }
        for (key, value) in &t.keyvalues {
            let r = self.set(key, value)?;
            if r < 0 {
                return Err(failed(format!("invalid conf option {key}"), r));
            }
        }
        // A failure only means the option does not exist, and librbd then does not cache.
        self.set("rbd_cache", if cache { "true" } else { "false" })?;
        Ok(())
    }

    fn set(&self, key: &str, value: &str) -> Result<c_int> {
        let (k, v) = (c_string(key)?, c_string(value)?);
        // SAFETY: an unconnected handle and two C strings, copied by librados.
        Ok(unsafe { (self.lib.rados_conf_set)(self.rados, k.as_ptr(), v.as_ptr()) })
    }

    /// Creates the image `t` names, of `size` bytes, with the pool's default features and
    /// object size (QEMU's `qemu_rbd_do_create`).
    pub fn create_image(&self, t: &RbdTarget, size: u64) -> Result<()> {
        if t.snapshot.is_some() {
            return Err(Error::invalid("Can't use snapshot name for image creation"));
        }
        let name = c_string(&t.image)?;
        let mut order: c_int = 0;
        // SAFETY: an open context, a C string, and the order (0: the default) to fill in.
        let r = unsafe { (self.lib.rbd_create)(self.ioctx, name.as_ptr(), size, &mut order) };
        match r < 0 {
            true => Err(failed("error rbd create", r)),
            false => Ok(()),
        }
    }

    /// Removes the image `t` names (a create that failed after making it).
    pub fn remove_image(&self, t: &RbdTarget) -> Result<()> {
        let name = c_string(&t.image)?;
        // SAFETY: an open context and a C string.
        let r = unsafe { (self.lib.rbd_remove)(self.ioctx, name.as_ptr()) };
        match r < 0 {
            true => Err(failed(format!("error removing {}", t.image), r)),
            false => Ok(()),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if !self.ioctx.is_null() {
            // SAFETY: a context made by rados_ioctx_create, released once; the images opened
            // in it were closed before (RbdStorage closes its image first).
            unsafe { (self.lib.rados_ioctx_destroy)(self.ioctx) };
        }
        // SAFETY: the handle made by rados_create, released once, after its context.
        unsafe { (self.lib.rados_shutdown)(self.rados) };
    }
}
