//! The NBD server and export an image names, read as QEMU's nbd driver reads them
//! (block/nbd.c): the file names `nbd://HOST[:PORT]/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`,
//! `nbd:HOST:PORT[:exportname=EXPORT]` and `nbd:unix:PATH[:exportname=EXPORT]`, or the options
//! `server.type`/`server.path`/`server.host`/`server.port` (or the older `path`, `host`,
//! `port`) and `export`.

use super::json::Json;
use super::options::{Leaf, Options};
use crate::error::{Error, Result};
use crate::storage::{NbdServer, NbdTarget};

/// The port an NBD URL without one means.
const DEFAULT_PORT: &str = "10809";

/// Options QEMU's nbd driver takes that change nothing vdisk does.
const IGNORED: &[&str] = &["reconnect-delay", "open-timeout", "tls-hostname"];

/// Options of an inet address that change nothing vdisk does.
const INET_IGNORED: &[&str] = &["numeric", "to", "ipv4", "ipv6", "keep-alive", "mptcp"];

/// The NBD node of `o`, with `filename` parsed into its options first when the node was
/// named by one.
pub fn target(mut o: Options, filename: Option<&str>) -> Result<NbdTarget> {
    if let Some(name) = filename {
        let conflict = o.keys().find(|k| {
            matches!(*k, "host" | "port" | "path" | "export") || k.starts_with("server.")
        });
        if let Some(k) = conflict {
            return Err(Error::invalid(format!(
                "Option '{k}' cannot be used with a file name"
            )));
        }
        parse_filename(name, &mut o)?;
    }
    legacy_options(&mut o)?;
    let server = match o.take_text("server.type").as_deref() {
        None if o.has_child("server") => {
            return Err(Error::invalid("Parameter 'server.type' is missing"))
        }
        None => return Err(Error::invalid("NBD server address missing")),
        Some("unix") => NbdServer::Unix(required(&mut o, "server.path")?),
        Some("inet") => {
            let host = required(&mut o, "server.host")?;
            let port = required(&mut o, "server.port")?;
            o.drop_where(|k| INET_IGNORED.iter().any(|i| k == format!("server.{i}")));
            NbdServer::Inet { host, port }
        }
        Some(other @ ("fd" | "vsock")) => {
            return Err(Error::unsupported(format!(
                "NBD servers of type '{other}' are not supported"
            )))
        }
        Some(other) => {
            return Err(Error::invalid(format!(
                "Parameter 'server.type' does not accept value '{other}'"
            )))
        }
    };
    let export = o.take_text("export");
    let dirty_bitmap = o.take_text("x-dirty-bitmap");
    if o.get("tls-creds").is_some() {
        return Err(Error::unsupported(
            "the nbd option 'tls-creds' is not supported",
        ));
    }
    o.drop_where(|k| IGNORED.contains(&k));
    o.refuse_rest("nbd", true)?;
    Ok(NbdTarget {
        server,
        export,
        dirty_bitmap,
    })
}

/// The options of `t` as QEMU lists them in a `json:` name.
pub fn options(t: &NbdTarget) -> Vec<(String, Json)> {
    let s = |v: &str| Json::Str(v.to_string());
    let mut out = match &t.server {
        NbdServer::Unix(path) => vec![("server.type", s("unix")), ("server.path", s(path))],
        NbdServer::Inet { host, port } => vec![
            ("server.type", s("inet")),
            ("server.host", s(host)),
            ("server.port", s(port)),
        ],
    };
    if let Some(e) = &t.export {
        out.push(("export", s(e)));
    }
    out.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

fn required(o: &mut Options, key: &str) -> Result<String> {
    o.take_text(key)
        .ok_or_else(|| Error::invalid(format!("Parameter '{key}' is missing")))
}

/// `path`, `host` and `port` as `server.*`, as `nbd_process_legacy_socket_options` does.
fn legacy_options(o: &mut Options) -> Result<()> {
    let (path, host, port) = (
        o.take_text("path"),
        o.take_text("host"),
        o.take_text("port"),
    );
    if path.is_none() && host.is_none() && port.is_none() {
        return Ok(());
    }
    if o.has_child("server") {
        return Err(Error::invalid(
            "Cannot use 'server' and path/host/port at the same time",
        ));
    }
    let put = |o: &mut Options, k: &str, v: String| o.put(k, Leaf::Str(v));
    match (path, host) {
        (Some(_), Some(_)) => {
            return Err(Error::invalid(
                "path and host may not be used at the same time",
            ))
        }
        (Some(_), None) if port.is_some() => {
            return Err(Error::invalid("port may not be used without host"))
        }
        (Some(path), None) => {
            put(o, "server.type", "unix".into());
            put(o, "server.path", path);
        }
        (None, Some(host)) => {
            put(o, "server.type", "inet".into());
            put(o, "server.host", host);
            put(
                o,
                "server.port",
                port.unwrap_or_else(|| DEFAULT_PORT.into()),
            );
        }
        // A port alone: QEMU ignores it too.
        (None, None) => {}
    }
    Ok(())
}

/// `nbd_parse_filename`: the server and export a file name gives, as options.
fn parse_filename(name: &str, o: &mut Options) -> Result<()> {
    if name.contains("://") {
        let uri = parse_uri(name).ok_or_else(|| Error::invalid("No valid URL specified"))?;
        for (k, v) in uri {
            o.put(k, Leaf::Str(v));
        }
        return Ok(());
    }
    const EXPORT: &str = ":exportname=";
    let mut file = name;
    if let Some(at) = name.find(EXPORT) {
        let export = &name[at + EXPORT.len()..];
        // As in QEMU: an empty export name leaves the whole file name unread.
        if export.is_empty() {
            return Ok(());
        }
        o.put("export", Leaf::Str(export.into()));
        file = &name[..at];
    }
    let host_spec = file
        .strip_prefix("nbd:")
        .ok_or_else(|| Error::invalid("File name string for NBD must start with 'nbd:'"))?;
    if host_spec.is_empty() {
        return Ok(());
    }
    if let Some(path) = host_spec.strip_prefix("unix:") {
        o.put("server.type", Leaf::Str("unix".into()));
        o.put("server.path", Leaf::Str(path.into()));
        return Ok(());
    }
    let (host, port) = inet_parse(host_spec)?;
    o.put("server.type", Leaf::Str("inet".into()));
    o.put("server.host", Leaf::Str(host));
    o.put("server.port", Leaf::Str(port));
    Ok(())
}

/// QEMU's `inet_parse`: `HOST:PORT`, `[IPV6]:PORT` or `:PORT`, options after a comma ignored.
fn inet_parse(spec: &str) -> Result<(String, String)> {
    let port_of = |rest: &str| -> Option<String> {
        let port = rest.strip_prefix(':')?.split(',').next()?;
        (!port.is_empty()).then(|| port.to_string())
    };
    let parsed = if let Some(v6) = spec.strip_prefix('[') {
        v6.split_once(']')
            .filter(|(h, _)| !h.is_empty())
            .and_then(|(h, rest)| Some((h.to_string(), port_of(rest)?)))
            .ok_or("IPv6 address")
    } else if spec.starts_with(':') {
        port_of(spec)
            .map(|p| (String::new(), p))
            .ok_or("port in address")
    } else {
        let at = spec.find(':').unwrap_or(spec.len());
        port_of(&spec[at..])
            .filter(|_| at > 0)
            .map(|p| (spec[..at].to_string(), p))
            .ok_or("address")
    };
    parsed.map_err(|what| Error::invalid(format!("error parsing {what} '{spec}'")))
}

/// `nbd_parse_uri`: the options of `nbd[+tcp]://HOST[:PORT]/EXPORT` or
/// `nbd+unix:///EXPORT?socket=PATH`, or `None` for anything QEMU calls no valid URL.
fn parse_uri(name: &str) -> Option<Vec<(&'static str, String)>> {
    let (scheme, rest) = name.split_once("://")?;
    let unix = match scheme {
        "nbd" | "nbd+tcp" => false,
        "nbd+unix" => true,
        _ => return None,
    };
    let rest = rest.split('#').next().unwrap_or("");
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let mut out = Vec::new();
    let export = decode(path.strip_prefix('/').unwrap_or(path))?;
    if !export.is_empty() {
        out.push(("export", export));
    }
    let params: Vec<(String, String)> = match query {
        Some(q) => q
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                // GLib refuses a parameter without '='.
                let (k, v) = p.split_once('=')?;
                Some((decode(k)?, decode(v)?))
            })
            .collect::<Option<_>>()?,
        None => Vec::new(),
    };
    // Without user information; a port must be a number.
    let host_port = authority.rsplit('@').next().unwrap_or("");
    let (host, port) = match host_port.strip_prefix('[') {
        Some(v6) => {
            let (h, rest) = v6.split_once(']')?;
            (h, rest.strip_prefix(':'))
        }
        None => match host_port.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (host_port, None),
        },
    };
    let port = match port {
        Some(p) if !p.is_empty() => Some(p.parse::<u16>().ok()?),
        _ => None,
    };
    if unix {
        let [(k, socket)] = params.as_slice() else {
            return None;
        };
        if k != "socket" || !host.is_empty() || port.is_some() {
            return None;
        }
        out.push(("server.type", "unix".into()));
        out.push(("server.path", socket.clone()));
    } else {
        if host.is_empty() || !params.is_empty() {
            return None;
        }
        out.push(("server.type", "inet".into()));
        out.push(("server.host", decode(host)?));
        let port = port.filter(|&p| p > 0).map(|p| p.to_string());
        out.push(("server.port", port.unwrap_or_else(|| DEFAULT_PORT.into())));
    }
    Some(out)
}

/// Percent-decoding; `None` for a malformed escape or text that is not UTF-8.
fn decode(text: &str) -> Option<String> {
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&b, tail)) = rest.split_first() {
        if b == b'%' {
            let hex = std::str::from_utf8(tail.get(..2)?).ok()?;
            bytes.push(u8::from_str_radix(hex, 16).ok()?);
            rest = &tail[2..];
        } else {
            bytes.push(b);
            rest = tail;
        }
    }
    String::from_utf8(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str) -> Result<NbdTarget> {
        target(Options::default(), Some(name))
    }

    #[test]
    fn file_names_name_servers_as_in_qemu() {
        let cases = [
            (
                "nbd+unix:///exp?socket=/tmp/s",
                "nbd+unix:///exp?socket=/tmp/s",
            ),
            ("nbd+unix://?socket=/tmp/s", "nbd+unix://?socket=/tmp/s"),
            (
                "nbd:unix:/tmp/s:exportname=exp",
                "nbd+unix:///exp?socket=/tmp/s",
            ),
            ("nbd:unix:/tmp/s", "nbd+unix://?socket=/tmp/s"),
            ("nbd://localhost:31527", "nbd://localhost:31527"),
            ("nbd://localhost:31527/", "nbd://localhost:31527"),
            ("nbd+tcp://localhost/a%20b", "nbd://localhost:10809/a b"),
            ("nbd://[::1]:99/e", "nbd://::1:99/e"),
            ("nbd:localhost:31527", "nbd://localhost:31527"),
            ("nbd:127.0.0.1:1:exportname=e", "nbd://127.0.0.1:1/e"),
        ];
        for (name, uri) in cases {
            assert_eq!(named(name).unwrap().uri(), uri, "{name}");
        }
    }

    #[test]
    fn bad_file_names_fail_with_qemus_messages() {
        let cases = [
            ("nbd+unix:///exp", "No valid URL specified"),
            ("nbd+unix://h/exp?socket=/s", "No valid URL specified"),
            ("nbd+unix:///exp?socket", "No valid URL specified"),
            ("nbd://localhost/e?socket=/s", "No valid URL specified"),
            ("nbd:///e", "No valid URL specified"),
            ("nbd://h:x/e", "No valid URL specified"),
            ("nbd:localhost", "error parsing address 'localhost'"),
            ("nbd:", "NBD server address missing"),
            ("nbd:unix:/s:exportname=", "NBD server address missing"),
        ];
        for (name, want) in cases {
            assert_eq!(named(name).unwrap_err().to_string(), want, "{name}");
        }
    }

    #[test]
    fn options_name_servers_as_in_qemu() {
        let mut o = Options::default();
        o.put("host", Leaf::Str("localhost".into()));
        o.put("port", Leaf::Num("31527".into()));
        assert_eq!(target(o, None).unwrap().uri(), "nbd://localhost:31527");
        let mut o = Options::default();
        o.put("path", Leaf::Num("42".into()));
        assert_eq!(target(o, None).unwrap().uri(), "nbd+unix://?socket=42");
        let mut o = Options::default();
        o.put("export", Leaf::Str("e".into()));
        let e = target(o, Some("nbd:unix:/s")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Option 'export' cannot be used with a file name"
        );
        let mut o = Options::default();
        o.put("server.type", Leaf::Str("unix".into()));
        let e = target(o, None).unwrap_err();
        assert_eq!(e.to_string(), "Parameter 'server.path' is missing");
    }
}
