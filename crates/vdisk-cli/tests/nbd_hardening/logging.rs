//! What `vdisk serve` logs, at which level.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use super::image;
use crate::nbd_common::*;

/// A client that reads the greeting and then sends something that is not an option.
fn bad_option(socket: &Path) {
    let mut s = UnixStream::connect(socket).unwrap();
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).unwrap();
    s.write_all(&3u32.to_be_bytes()).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n").unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
}

/// By default (warn, as qemu-nbd) the log has protocol violations and nothing about clients
/// that come and go; `-v`, `--log-level info` or `VDISK_LOG=info` add the connections, with
/// their peer; `--log-level` wins over the environment; a bad level is refused.
#[test]
fn serve_logs_by_level() {
    let Some(tools) = peers(&["nbdinfo"]) else {
        return;
    };
    let nbdinfo = &tools[0];
    let d = scratch("log");
    let d = d.path();
    let img = image(d);
    let session = |args: &[&str], env: &[(&str, &str)]| {
        let mut all = vec![img.as_str(), "-f", "raw"];
        all.extend_from_slice(args);
        let serve = Serve::start_env(d, &all, env);
        run(nbdinfo, &["--size", &serve.uri("")]);
        bad_option(&serve.socket);
        serve.stop_clean()
    };

    let quiet = session(&[], &[]);
    assert!(
        quiet.contains("vdisk: warn: nbd: closing the connection of #2 unix socket client (pid ")
            && quiet.contains("bad option magic 0x474554202f204854"),
        "{quiet}"
    );
    assert!(!quiet.contains("connected"), "{quiet}");
    assert!(!quiet.contains("info:"), "{quiet}");

    for (args, env) in [
        (&["-v"][..], &[][..]),
        (&["--log-level", "info"][..], &[][..]),
        (&[][..], &[("VDISK_LOG", "info")][..]),
        (&["--log-level", "INFO"][..], &[("VDISK_LOG", "error")][..]),
    ] {
        let log = session(args, env);
        for want in [
            "vdisk: info: nbd: #1 unix socket client (pid ",
            "): connected",
            "): export '', structured replies on",
            "): disconnected",
            "vdisk: warn: nbd: closing the connection of #2",
        ] {
            assert!(
                log.contains(want),
                "{args:?} {env:?}: no '{want}' in:\n{log}"
            );
        }
        assert!(!log.contains("debug:"), "{log}");
    }

    let errors_only = session(&["--log-level", "error"], &[("VDISK_LOG", "debug")]);
    assert!(!errors_only.contains("vdisk: "), "{errors_only}");

    let debug = session(&[], &[("VDISK_LOG", "warn,vdisk=debug")]);
    assert!(debug.contains("vdisk: debug: "), "{debug}");

    let (ok, _, err) = try_run(
        &vdisk_bin(),
        &[
            "serve",
            &img,
            "--nbd",
            "unix:/nonexistent/s",
            "--log-level",
            "loud",
        ],
    );
    assert!(!ok && err.contains("invalid log level 'loud'"), "{err}");
}
