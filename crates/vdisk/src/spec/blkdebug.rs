//! QEMU's blkdebug driver as its options name it (block/blkdebug.c): `blkdebug:CONF:IMAGE`,
//! or `driver=blkdebug` with `config`, `image` (or `x-image`), `inject-error` and `set-state`
//! rule lists and alignment overrides. The rules come from the config file (QEMU's ini-like
//! `qemu_config_parse` syntax, read when the name is) and from the options; the engine that
//! applies them is `storage::blkdebug`.
//!
//! Nothing here trusts the config file: a bad line, group, key or value is an error in QEMU's
//! words, never a panic.

use super::json::Json;
use super::options::{Leaf, Options};
use super::values::{option_number, parse_bool};
use crate::error::{Error, Result};
use crate::storage::{BlkdebugAction, BlkdebugRule, Inject, EVENT_NAMES, IOTYPE_NAMES};

/// What the options of a blkdebug node say, besides its image.
#[derive(Debug, Clone, PartialEq)]
pub struct Blkdebug {
    /// The config file, as named.
    pub config: Option<String>,
    pub rules: Vec<BlkdebugRule>,
    /// The node's options other than its image and config, as given, for its `json:` name
    /// (with any, QEMU names the node by `json:`, else `blkdebug:CONF:IMAGE`).
    pub given: Vec<(String, Json)>,
}

/// The parts of a `blkdebug:CONF:IMAGE` name.
pub fn split_filename(name: &str) -> Result<(Option<String>, &str)> {
    let rest = name.strip_prefix("blkdebug:").unwrap_or(name);
    let Some(colon) = rest.find(':') else {
        return Err(Error::invalid(
            "blkdebug requires both config file and image path",
        ));
    };
    let config = (colon > 0).then(|| rest[..colon].to_string());
    Ok((config, &rest[colon + 1..]))
}

/// Takes a blkdebug node's own options out of `o` (leaving its image's), reading `config`
/// (the name's, or the options') and the rules.
pub fn take(o: &mut Options, config: Option<String>) -> Result<Blkdebug> {
    let config = config.or_else(|| o.take_text("config"));
    let mut given = Vec::new();
    let mut rules = Vec::new();
    if let Some(path) = &config {
        let text = std::fs::read(path).map_err(|source| Error::Io {
            context: "Could not read blkdebug config file".into(),
            source,
        })?;
        rules.extend(parse_config(&String::from_utf8_lossy(&text))?);
    }
    for (group, action) in [("inject-error", true), ("set-state", false)] {
        if !o.has_child(group) {
            if let Some(Leaf::Empty(j)) = o.take(group) {
                given.push((group.to_string(), j));
            }
            continue;
        }
        // Flattened as `inject-error.0.event`: grouped back by index.
        let list = o.take_child(group);
        let mut by_index: Vec<(u64, Vec<(String, Json)>)> = Vec::new();
        for (key, leaf) in list.json() {
            let (index, field) = key.split_once('.').unwrap_or((&key, ""));
            let index = index
                .parse::<u64>()
                .map_err(|_| Error::invalid(format!("Invalid parameter '{group}.{key}'")))?;
            let at = match by_index.iter().position(|(i, _)| *i == index) {
                Some(at) => at,
                None => {
                    by_index.push((index, Vec::new()));
                    by_index.len() - 1
                }
            };
            if !field.is_empty() {
                by_index[at].1.push((field.to_string(), leaf));
            }
        }
        by_index.sort_by_key(|(i, _)| *i);
        let mut listed = Vec::new();
        for (_, fields) in by_index {
            let text: Vec<(String, String)> = fields
                .iter()
                .map(|(k, v)| (k.clone(), json_text(v)))
                .collect();
            rules.push(rule(group, action, false, &text)?);
            listed.push(Json::Dict(fields));
        }
        given.push((group.to_string(), Json::List(listed)));
    }
    for key in [
        "align",
        "max-transfer",
        "opt-write-zero",
        "max-write-zero",
        "opt-discard",
        "max-discard",
    ] {
        if let Some(v) = o.get(key).cloned() {
            given.push((key.to_string(), v.json()));
        }
        let size = o.take_size(key)?;
        // QEMU checks the others against the image's alignment too; vdisk moves whole
        // requests, so only the alignment itself is checked.
        if let (Some(n), "align") = (size, key) {
            if n >= i32::MAX as u64 || !n.is_power_of_two() {
                return Err(Error::invalid(format!(
                    "Cannot meet constraints with align {n}"
                )));
            }
        }
    }
    for child in ["take-child-perms", "unshare-child-perms"] {
        o.take_child(child);
        o.take(child);
    }
    Ok(Blkdebug {
        config,
        rules,
        given,
    })
}

/// A JSON scalar as option text, as `qemu_opts_absorb_qdict` converts it.
fn json_text(v: &Json) -> String {
    match v {
        Json::Str(s) | Json::Num(s) => s.clone(),
        Json::Bool(b) => if *b { "on" } else { "off" }.into(),
        other => other.compact(),
    }
}

/// One rule of `group` from its `key = value` fields (of a config file, or of the options),
/// checked as QEMU's `add_rule` checks it.
fn rule(
    group: &str,
    inject: bool,
    file: bool,
    fields: &[(String, String)],
) -> Result<BlkdebugRule> {
    let known: &[&str] = match inject {
        true => &[
            "event",
            "state",
            "iotype",
            "errno",
            "sector",
            "once",
            "immediately",
        ],
        false => &["event", "state", "new_state"],
    };
    if let Some((k, _)) = fields.iter().find(|(k, _)| !known.contains(&k.as_str())) {
        return Err(Error::invalid(match file {
            true => format!("Invalid parameter '{k}'"),
            false => format!("[{group}] section doesn't support the option '{k}'"),
        }));
    }
    let get = |k: &str| {
        fields
            .iter()
            .rev()
            .find(|(f, _)| f == k)
            .map(|(_, v)| v.as_str())
    };
    let number = |k: &str| -> Result<Option<u64>> {
        get(k)
            .map(|v| option_number(k, v).map_err(Error::invalid))
            .transpose()
    };
    let flag = |k: &str| -> Result<bool> {
        Ok(get(k)
            .map(|v| parse_bool(k, v).map_err(Error::invalid))
            .transpose()?
            .unwrap_or(false))
    };
    let name = get("event").ok_or_else(|| Error::invalid("Missing event name for rule"))?;
    let event = EVENT_NAMES
        .iter()
        .position(|n| *n == name)
        .ok_or_else(|| Error::invalid(format!("invalid parameter value: {name}")))?;
    let state = number("state")?.unwrap_or(0);
    let action = match inject {
        true => {
            let iotypes = match get("iotype") {
                None => 0b1_1111, // everything but block-status, as QEMU's default
                Some(t) => match IOTYPE_NAMES.iter().position(|n| *n == t) {
                    Some(i) => 1 << i,
                    None => return Err(Error::invalid(format!("invalid parameter value: {t}"))),
                },
            };
            let errno = number("errno")?.unwrap_or(libc::EIO as u64);
            // As QEMU's int64 arithmetic: -1 is "any sector", a product past 2^64 wraps.
            let offset = number("sector")?
                .filter(|&s| s != u64::MAX)
                .map(|s| s.wrapping_mul(512));
            flag("immediately")?;
            BlkdebugAction::Inject(Inject {
                iotypes,
                errno: i32::try_from(errno).unwrap_or(libc::EIO),
                once: flag("once")?,
                offset,
            })
        }
        false => BlkdebugAction::SetState(number("new_state")?.unwrap_or(0)),
    };
    Ok(BlkdebugRule {
        event,
        state,
        action,
    })
}

/// The rules of a config file, read as QEMU's `qemu_config_parse` reads one, sscanf's
/// leniency included: `[group]` (or `[group "id"]`) lines, blank lines and `#` comments, and
/// any other line's first word is a key, whose value is what stands between quotes after an
/// `=` (or nothing, when the line has no such part).
fn parse_config(text: &str) -> Result<Vec<BlkdebugRule>> {
    let mut rules = Vec::new();
    let mut group: Option<(String, Vec<(String, String)>)> = None;
    let mut finish = |g: Option<(String, Vec<(String, String)>)>| -> Result<()> {
        let Some((name, fields)) = g else {
            return Ok(());
        };
        match name.as_str() {
            "inject-error" => rules.push(rule(&name, true, true, &fields)?),
            "set-state" => rules.push(rule(&name, false, true, &fields)?),
            _ => return Err(Error::invalid(format!("There is no option group '{name}'"))),
        }
        Ok(())
    };
    for line in text.split_inclusive('\n') {
        if line.starts_with('\n') || line.starts_with('#') {
            continue;
        }
        // sscanf reads a C string: a NUL ends the line.
        let line = line.split('\0').next().unwrap_or("");
        if let Some(name) = line.strip_prefix('[').and_then(group_name) {
            finish(group.take())?;
            group = Some((name, Vec::new()));
            continue;
        }
        let (key, value) = key_value(line).ok_or_else(|| Error::invalid("parse error"))?;
        let Some((_, fields)) = group.as_mut() else {
            return Err(Error::invalid("no group defined"));
        };
        fields.push((key, value));
    }
    finish(group)?;
    Ok(rules)
}

/// The group a `[` line opens, as `sscanf("[%63s \"%63[^\"]\"]")` or else `"[%63[^]]]"` read
/// it: its first word when an id in quotes follows, else everything up to `]` (or to the end
/// of the line, its newline too); `None` when not even one character is there.
fn group_name(rest: &str) -> Option<String> {
    let word_end = rest.find(char::is_whitespace).unwrap_or(rest.len());
    let (word, after) = rest.split_at(word_end);
    let with_id = after
        .trim_start()
        .strip_prefix('"')
        .and_then(|r| r.split_once('"'))
        .is_some_and(|(id, _)| !id.is_empty());
    if !word.is_empty() && with_id {
        return Some(word.to_string());
    }
    let name = rest.split(']').next().unwrap_or("");
    (!name.is_empty()).then(|| name.to_string())
}

/// A key line, as `sscanf(" %63s = \"%1023[^\"]\"")` or else `" %63s = \"\""` read it: its
/// first word, and the quoted value after `=` if there is one, else nothing; `None` for a
/// line of blanks.
fn key_value(line: &str) -> Option<(String, String)> {
    let line = line.trim_start();
    let end = line.find(char::is_whitespace).unwrap_or(line.len());
    if end == 0 {
        return None;
    }
    let (key, rest) = line.split_at(end);
    let value = rest
        .trim_start()
        .strip_prefix('=')
        .map(str::trim_start)
        .and_then(|r| r.strip_prefix('"'))
        .map(|r| r.split('"').next().unwrap_or(""))
        .unwrap_or("");
    Some((key.to_string(), value.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_files_read_as_qemu_reads_them() {
        let rules = parse_config(
            "# comment\n\n[inject-error]\nevent = \"read_aio\"\nerrno = \"5\"\nonce =\"off\"\n\
             [set-state \"x\"]\nevent = \"write_aio\"\nnew_state = \"2\"\n",
        )
        .unwrap();
        assert_eq!(rules.len(), 2);
        assert_eq!(EVENT_NAMES[rules[0].event], "read_aio");
        assert_eq!(rules[1].action, BlkdebugAction::SetState(2));
        // The messages are qemu-img's for the same files (checked by hand against QEMU 10.0).
        for (bad, why) in [
            ("event = \"read_aio\"\n", "no group defined"),
            ("[inject-error]\n   \n", "parse error"),
            (
                "[inject-error]\nevent = read_aio\n",
                "invalid parameter value: ",
            ),
            (
                "[inject-error]\nevent=\"none\"\n",
                "Invalid parameter 'event=\"none\"'",
            ),
            (
                "[inject-error]\nerrno = \"5\"\n",
                "Missing event name for rule",
            ),
            (
                "[inject-error]\nevent = \"nope\"\n",
                "invalid parameter value: nope",
            ),
            (
                "[inject-error]\nevent = \"none\"\nsector = \"99999999999999999999\"\n",
                "too large",
            ),
            (
                "[inject-error]\nevent = \"none\"\nbogus = \"1\"\n",
                "Invalid parameter 'bogus'",
            ),
            ("[bogus]\nevent = \"none\"\n", "no option group 'bogus'"),
            (
                "[inject-error\nevent = \"none\"\n",
                "no option group 'inject-error\n'",
            ),
            ("[", "no group defined"),
            ("[]\n", "no group defined"),
            ("\0[\n", "parse error"),
        ] {
            let e = parse_config(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn names_split_at_the_config() {
        assert_eq!(
            split_filename("blkdebug:c.conf:x.img").unwrap(),
            (Some("c.conf".into()), "x.img")
        );
        assert_eq!(split_filename("blkdebug::x:y").unwrap(), (None, "x:y"));
        assert!(split_filename("blkdebug:x.img").is_err());
    }
}
