//! Flags several subcommands share: how they are parsed and checked.

use std::process::ExitCode;

use clap::ValueEnum;
use vdisk::CacheMode;

use crate::report::fail;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Human,
    Json,
}

/// Parses a cache mode (`-t`) by qemu-img's names.
pub fn parse_cache(name: &str) -> Result<CacheMode, String> {
    CacheMode::parse(name).map_err(|e| e.to_string())
}

/// Refuses a cache mode (`-t`, `-T`) qemu-img does not know, before anything is opened.
pub fn bad_cache(mode: Option<&str>, which: &str) -> Option<ExitCode> {
    let mode = mode?;
    CacheMode::parse(mode)
        .is_err()
        .then(|| fail(format!("Invalid {which}cache option: {mode}"), 1))
}
