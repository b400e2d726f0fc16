//! The crash model, checked against states worked out by hand.

use std::collections::HashSet;

use super::*;

fn images(s: &CrashStorage) -> HashSet<Vec<u8>> {
    s.crash_images().map(|i| i.bytes).collect()
}

fn set<const N: usize>(images: [&[u8]; N]) -> HashSet<Vec<u8>> {
    images.iter().map(|i| i.to_vec()).collect()
}

fn torn() -> CrashOptions {
    CrashOptions {
        torn_writes: true,
        ..CrashOptions::default()
    }
}

#[test]
fn unsynced_writes_survive_in_any_subset_and_synced_ones_always() {
    let s = CrashStorage::new();
    s.write_at(0, b"A").unwrap();
    s.sync().unwrap();
    s.write_at(1, b"B").unwrap();
    s.write_at(2, b"C").unwrap();
    // {A}, {A,B}, {A,C}, {A,B,C}: C may land without B; A is never lost.
    assert_eq!(images(&s), set([b"A", b"AB", b"A\0C", b"ABC"]));
    s.sync().unwrap();
    assert_eq!(images(&s), set([b"ABC"]));
}

#[test]
fn reads_see_the_volatile_view_and_power_loss_drops_it() {
    let s = CrashStorage::from_bytes(b"old".to_vec());
    s.write_at(0, b"new!").unwrap();
    let mut buf = [0u8; 4];
    s.read_at(0, &mut buf).unwrap();
    assert_eq!(&buf, b"new!");
    assert_eq!(s.durable(), b"old");
    assert_eq!(s.unsynced().len(), 1);
    s.power_loss();
    assert_eq!(s.to_bytes(), b"old");
    assert!(s.unsynced().is_empty());
}

#[test]
fn an_older_write_never_lands_over_a_newer_one() {
    let s = CrashStorage::from_bytes(b"old.".to_vec());
    s.write_at(0, b"11").unwrap();
    s.write_at(0, b"2222").unwrap();
    let got = images(&s);
    assert_eq!(got, set([b"old.", b"11d.", b"2222"]));
    assert!(!got.contains(b"1122".as_slice()));
}

#[test]
fn punch_set_len_and_writes_combine_in_issue_order() {
    let s = CrashStorage::new();
    s.write_at(0, &[7; 8]).unwrap();
    s.sync().unwrap();
    s.punch_hole(0, 4).unwrap();
    s.set_len(2).unwrap();
    s.write_at(4, &[9; 2]).unwrap();
    assert_eq!(s.to_bytes(), [0, 0, 0, 0, 9, 9]);
    let want = set([
        &[7, 7, 7, 7, 7, 7, 7, 7],
        &[0, 0, 0, 0, 7, 7, 7, 7],
        &[7, 7],
        &[7, 7, 7, 7, 9, 9, 7, 7],
        &[0, 0],
        &[0, 0, 0, 0, 9, 9, 7, 7],
        // Truncated, then grown by the write: the old bytes in between never come back.
        &[7, 7, 0, 0, 9, 9],
        &[0, 0, 0, 0, 9, 9],
    ]);
    assert_eq!(images(&s), want);
}

#[test]
fn an_allocation_may_be_lost_but_a_synced_one_stays() {
    let s = CrashStorage::from_bytes(vec![1; 4]);
    s.allocate(0, 16).unwrap();
    assert_eq!(s.len().unwrap(), 16);
    let lens: HashSet<usize> = s.crash_images().map(|i| i.bytes.len()).collect();
    assert_eq!(lens, HashSet::from([4, 16]));
    s.sync().unwrap();
    s.set_len(8).unwrap();
    let lens: HashSet<usize> = s.crash_images().map(|i| i.bytes.len()).collect();
    assert_eq!(lens, HashSet::from([8, 16]));
}

#[test]
fn torn_writes_persist_any_subset_of_whole_sectors() {
    let s = CrashStorage::new().with_options(torn());
    s.write_at(0, &[1; 1536]).unwrap();
    let want: HashSet<Vec<u8>> = (0..8u32)
        .map(|mask| {
            let top = (0..3)
                .filter(|b| mask >> b & 1 == 1)
                .max()
                .map_or(0, |b| b + 1);
            let mut image = vec![0; top * 512];
            for b in (0..3).filter(|b| mask >> b & 1 == 1) {
                image[b * 512..(b + 1) * 512].fill(1);
            }
            image
        })
        .collect();
    assert_eq!(images(&s), want);
    // Without the option a write is all or nothing.
    let s = CrashStorage::new();
    s.write_at(0, &[1; 1536]).unwrap();
    assert_eq!(images(&s), set([b"", &[1; 1536]]));
}

#[test]
fn tearing_follows_absolute_sector_boundaries() {
    let s = CrashStorage::from_bytes(vec![5; 1024]).with_options(torn());
    s.write_at(300, &[1; 600]).unwrap();
    let (mut head, mut tail, mut both) = (vec![5; 1024], vec![5; 1024], vec![5; 1024]);
    head[300..512].fill(1);
    tail[512..900].fill(1);
    both[300..900].fill(1);
    assert_eq!(images(&s), set([&[5; 1024], &head, &tail, &both]));
    // A write inside one sector is atomic.
    let s = CrashStorage::from_bytes(vec![5; 512]).with_options(torn());
    s.write_at(10, &[1; 100]).unwrap();
    assert_eq!(s.crash_images().count(), 2);
}

#[test]
fn a_large_torn_write_stays_bounded_and_sector_atomic() {
    let s = CrashStorage::new().with_options(torn());
    s.write_at(0, &vec![1; 1 << 20]).unwrap();
    let all: Vec<CrashImage> = s.crash_images().collect();
    assert!(all.len() <= 2 + 3 * torn().torn_samples + torn().random_subsets);
    for image in &all {
        assert_eq!(image.bytes.len() % 512, 0, "{image}");
        for sector in image.bytes.chunks(512) {
            assert!(sector.iter().all(|&b| b == sector[0]), "{image}");
        }
    }
}

#[test]
fn epochs_replay_the_history_and_cover_it_without_duplicates() {
    let s = CrashStorage::new();
    s.write_at(0, b"A").unwrap();
    s.sync().unwrap();
    s.write_at(1, b"B").unwrap();
    s.sync().unwrap();
    s.write_at(2, b"C").unwrap();
    let epochs: Vec<Epoch> = s.epochs().collect();
    let shape: Vec<_> = epochs
        .iter()
        .map(|e| (e.index, e.synced, &e.base[..]))
        .collect();
    assert_eq!(
        shape,
        [(0, true, &b""[..]), (1, true, b"A"), (2, false, b"AB")]
    );
    assert_eq!(epochs[2].end(), b"ABC");
    let all: Vec<Vec<u8>> = s.all_crash_images().map(|i| i.bytes).collect();
    assert_eq!(all, [&b""[..], b"A", b"AB", b"ABC"]);

    s.forget_history();
    let epochs: Vec<Epoch> = s.epochs().collect();
    assert_eq!(epochs.len(), 1);
    assert_eq!((epochs[0].index, &epochs[0].base[..]), (2, &b"AB"[..]));
}

/// The claim of the module docs: crashing at the end of each epoch covers crashing anywhere.
#[test]
fn the_end_of_each_epoch_covers_every_crash_point() {
    let s = CrashStorage::from_bytes(vec![0; 64]).with_options(torn());
    let mut seen = HashSet::new();
    let steps: [&dyn Fn(&CrashStorage); 9] = [
        &|s| s.write_at(0, &[1; 700]).unwrap(),
        &|s| s.punch_hole(100, 200).unwrap(),
        &|s| s.sync().unwrap(),
        &|s| s.set_len(600).unwrap(),
        &|s| s.write_at(1000, &[2; 30]).unwrap(),
        &|s| s.allocate(0, 2048).unwrap(),
        &|s| s.sync().unwrap(),
        &|s| s.write_at(20, &[3; 1100]).unwrap(),
        &|s| s.write_at(0, &[4; 10]).unwrap(),
    ];
    for step in steps {
        seen.extend(images(&s));
        step(&s);
    }
    seen.extend(images(&s));
    let all: HashSet<Vec<u8>> = s.all_crash_images().map(|i| i.bytes).collect();
    assert!(seen.is_subset(&all));
}

#[test]
fn many_pending_writes_give_every_prefix_and_a_reproducible_sample() {
    let s = CrashStorage::from_bytes(vec![0xaa; 30]);
    for i in 0..30u8 {
        s.write_at(u64::from(i), &[i]).unwrap();
    }
    let all: Vec<CrashImage> = s.crash_images().collect();
    assert_eq!(all.len(), 31 + s.options().random_subsets);
    for k in 0..=30u8 {
        let mut prefix = vec![0xaa; 30];
        prefix[..k as usize].copy_from_slice(&(0..k).collect::<Vec<u8>>());
        assert!(all.iter().any(|i| i.bytes == prefix), "prefix {k}");
    }
    for image in &all {
        assert!(image
            .bytes
            .iter()
            .enumerate()
            .all(|(i, &b)| b == 0xaa || b == i as u8));
    }
    assert_eq!(all, s.crash_images().collect::<Vec<_>>());
}

#[test]
fn concurrent_writers_are_logged_in_the_order_reads_saw() {
    let s = std::sync::Arc::new(CrashStorage::new());
    std::thread::scope(|scope| {
        for t in 0..4u8 {
            let s = &s;
            scope.spawn(move || {
                for i in 0..50u64 {
                    s.write_at(i * 4 + u64::from(t), &[t + 1]).unwrap();
                }
            });
        }
    });
    assert_eq!(s.open_epoch().end(), s.to_bytes());
    s.sync().unwrap();
    assert_eq!(s.durable(), s.to_bytes());
}

#[test]
fn crash_images_name_what_persisted() {
    let s = CrashStorage::new().with_options(torn());
    s.write_at(0, b"x").unwrap();
    s.write_at(0, &[1; 1024]).unwrap();
    let torn = s
        .crash_images()
        .find(|i| i.persisted.len() == 2 && i.persisted[1].sectors.is_some())
        .unwrap();
    assert_eq!(
        torn.to_string(),
        "epoch 0, persisted ops [0, 1 (sectors 0)] of 512 bytes"
    );
}
