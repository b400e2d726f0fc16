//! Writes and reads, reopening, thin provisioning, segment rollover, syncs per flush.

use super::*;

/// Writes of every alignment read back before and after a flush, after a reopen, and after a
/// drop without a flush (the handle commits what it holds).
#[test]
fn writes_read_back_and_survive_reopen() {
    let cs = 64 << 10;
    let storage = new_image(4 << 20, cs, None);
    let disk = open(&storage, true);
    let writes = [
        (0u64, 4096usize),
        (100, 1000),
        (cs - 10, 30),
        (3 * cs + 4095, 2 * cs as usize + 3),
        ((4 << 20) - 512, 512),
    ];
    let mut model = vec![0u8; 4 << 20];
    for (i, &(at, n)) in writes.iter().enumerate() {
        let d = pattern(i as u64, at, n);
        disk.write(at, &d).unwrap();
        model[at as usize..at as usize + n].copy_from_slice(&d);
        same(&read(&disk, 0, model.len()), &model, &format!("write {i}"));
    }
    disk.flush().unwrap();
    drop(disk);
    let disk = open(&storage, false);
    same(&read(&disk, 0, model.len()), &model, "reopened");
    drop(disk);
    let disk = open(&storage, true);
    let d = pattern(9, 7 * cs + 5, 300);
    disk.write(7 * cs + 5, &d).unwrap();
    model[(7 * cs + 5) as usize..(7 * cs + 305) as usize].copy_from_slice(&d);
    drop(disk);
    let disk = open(&storage, false);
    same(
        &read(&disk, 0, model.len()),
        &model,
        "dropped without a flush",
    );
    let mut problems = Vec::new();
    let report = disk.check_image(&mut |m| problems.push(m)).unwrap();
    assert_eq!((report.corruptions, report.leaks), (0, 0), "{problems:?}");
}

/// The file grows by the clusters written only: one super cluster at first, then a meta
/// cluster and one data cluster per cluster touched; rewriting and zeroing fresh space add
/// nothing.
#[test]
fn the_file_grows_only_with_clusters_written() {
    let cs = 64 << 10;
    let storage = new_image(1 << 30, cs, None);
    assert_eq!(len(&storage), cs);
    let disk = open(&storage, true);
    disk.write(5 * cs + 8192, &[1; 4096]).unwrap();
    assert_eq!(len(&storage), 3 * cs, "super, meta, one data cluster");
    disk.write(700 * cs, &[2; 100]).unwrap();
    disk.write(9000 * cs + 4000, &[3; 200]).unwrap();
    assert_eq!(len(&storage), 5 * cs);
    disk.write(5 * cs, &[4; 65536]).unwrap();
    disk.write(700 * cs + 50, &[5; 10]).unwrap();
    disk.write_zeroes(100 * cs, 50 * cs).unwrap();
    disk.flush().unwrap();
    assert_eq!(len(&storage), 5 * cs, "rewrites and zeroes of fresh space");
    same(&read(&disk, 5 * cs, 65536), &[4; 65536], "rewritten");
    let mut want = vec![0u8; 8192];
    want[4000..4200].fill(3);
    same(&read(&disk, 9000 * cs, 8192), &want, "across a page");
}

/// Small clusters fill a segment quickly: writes across several segments come back after a
/// reopen, cur_segment_num counts them, and every segment but the last is full.
#[test]
fn segments_roll_over() {
    let cs = 4096;
    let storage = new_image(8 << 20, cs, None);
    let disk = open(&storage, true);
    let per = disk.sb.geo.per_segment() as u64;
    let clusters = 2 * per + 100;
    for i in 0..clusters {
        // Out of order, some clusters in part (their other bytes read as zeroes).
        let n = (i * 7) % 2048;
        disk.write(n * cs + 512, &pattern(n, n * cs + 512, 1024))
            .unwrap();
        if i % 300 == 299 {
            disk.flush().unwrap();
        }
    }
    disk.flush().unwrap();
    drop(disk);
    assert_eq!(super_of(&*storage).segments, 3);
    assert_eq!(len(&storage), (1 + 3 + clusters) * cs);
    let disk = open(&storage, false);
    let st = disk.state();
    let counters: Vec<u32> = st.parts[0].segments.iter().map(|s| s.committed).collect();
    assert_eq!(counters, [per as u32, per as u32, 100]);
    drop(st);
    for i in 0..clusters {
        let n = (i * 7) % 2048;
        let mut want = vec![0u8; 4096];
        want[512..1536].copy_from_slice(&pattern(n, n * cs + 512, 1024));
        same(&read(&disk, n * cs, 4096), &want, &format!("cluster {n}"));
    }
}

/// A flush costs a constant number of syncs however much it commits: none with nothing to
/// commit, one for overwrites in place, three for new clusters, four when segments start.
#[test]
fn a_flush_costs_at_most_four_syncs() {
    let cs = 4096;
    let storage = new_image(8 << 20, cs, None);
    let disk = open(&storage, true);
    let syncs = || storage.stats().snapshot().syncs;
    let flushed = |what: &str, want: u64| {
        let before = syncs();
        disk.flush().unwrap();
        assert_eq!(syncs() - before, want, "{what}");
    };
    flushed("nothing written", 0);
    for n in 0..10u64 {
        disk.write(n * cs, &[n as u8; 4096]).unwrap();
    }
    flushed("the first segment started", 3);
    for n in 10..1000u64 {
        disk.write(n * cs, &[n as u8; 4096]).unwrap();
    }
    flushed("the first segment filled, the next started", 4);
    for n in 1000..1005u64 {
        disk.write(n * cs, &[1; 4096]).unwrap();
    }
    flushed("new clusters", 3);
    for n in 0..1005u64 {
        disk.write(n * cs + 8, &[2; 8]).unwrap();
    }
    flushed("in place", 1);
    flushed("nothing again", 0);
}
