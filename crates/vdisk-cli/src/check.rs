//! `vdisk check`: the report, messages and exit status of `qemu-img check`.

use std::process::ExitCode;

use vdisk::formats::qcow2::check::{check, CheckReport};
use vdisk::open_image;

use crate::qjson::{self, Dict};
use crate::{fail, read_options, Output};

/// Exit status when the format has no consistency check (qemu-img's 63).
const NO_CHECK: u8 = 63;

pub fn run(filename: &str, format: Option<&str>, output: Output, quiet: bool) -> ExitCode {
    let opts = match read_options(format) {
        Ok(o) => o,
        Err(e) => return fail(e, 1),
    };
    let image = match open_image(filename, &opts) {
        Ok(i) => i,
        Err(e) => return fail(e, 1),
    };
    let Some(q) = image.qcow2() else {
        return fail("This image format does not support checks", NO_CHECK);
    };
    let report = match check(q, &mut |m| eprintln!("{m}")) {
        Ok(r) => r,
        Err(failed) => return fail(format!("Check failed: {}", failed.error), 1),
    };
    if !quiet {
        match output {
            Output::Human => print!("{}", human(&report)),
            Output::Json => println!("{}", qjson::to_pretty(&json(&report, filename))),
        }
    }
    if report.check_errors > 0 {
        return fail("Check failed", 1);
    }
    ExitCode::from(if report.corruptions > 0 {
        2
    } else if report.leaks > 0 {
        3
    } else {
        0
    })
}

fn human(r: &CheckReport) -> String {
    let mut s = String::new();
    if r.corruptions == 0 && r.leaks == 0 && r.check_errors == 0 {
        s += "No errors were found on the image.\n";
    } else {
        if r.corruptions > 0 {
            s += &format!(
                "\n{} errors were found on the image.\nData may be corrupted, or further writes to the image may corrupt it.\n",
                r.corruptions
            );
        }
        if r.leaks > 0 {
            s += &format!(
                "\n{} leaked clusters were found on the image.\nThis means waste of disk space, but no harm to data.\n",
                r.leaks
            );
        }
        if r.check_errors > 0 {
            s += &format!(
                "\n{} internal errors have occurred during the check.\n",
                r.check_errors
            );
        }
    }
    if r.total_clusters != 0 && r.allocated_clusters != 0 {
        let pct = |n: u64, d: u64| n as f64 * 100.0 / d as f64;
        s += &format!(
            "{}/{} = {:.2}% allocated, {:.2}% fragmented, {:.2}% compressed clusters\n",
            r.allocated_clusters,
            r.total_clusters,
            pct(r.allocated_clusters, r.total_clusters),
            pct(r.fragmented_clusters, r.allocated_clusters),
            pct(r.compressed_clusters, r.allocated_clusters)
        );
    }
    if r.image_end_offset != 0 {
        s += &format!("Image end offset: {}\n", r.image_end_offset);
    }
    s
}

fn json(r: &CheckReport, filename: &str) -> qjson::Value {
    let mut d = Dict::new();
    d.put("filename", filename)
        .put("format", "qcow2")
        .put("check-errors", r.check_errors);
    for (key, value) in [
        ("image-end-offset", r.image_end_offset),
        ("corruptions", r.corruptions),
        ("leaks", r.leaks),
        ("corruptions-fixed", r.corruptions_fixed),
        ("leaks-fixed", r.leaks_fixed),
        ("total-clusters", r.total_clusters),
        ("allocated-clusters", r.allocated_clusters),
        ("fragmented-clusters", r.fragmented_clusters),
        ("compressed-clusters", r.compressed_clusters),
    ] {
        if value != 0 {
            d.put(key, value);
        }
    }
    d.build()
}
