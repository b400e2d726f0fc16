//! Snapshots: create, list, apply (roll back by cutting at the snapshot), delete.

use super::*;

fn names(disk: &Pcow) -> Vec<String> {
    disk.snapshot_list().into_iter().map(|s| s.name).collect()
}

/// Reads the whole disk.
fn all(disk: &Pcow) -> Vec<u8> {
    read(disk, 0, disk.size() as usize)
}

#[test]
fn snapshots_are_created_listed_applied_and_deleted() {
    let cs = 64 << 10;
    let storage = new_image(1 << 20, cs, None);
    let mut disk = open(&storage, true);
    disk.write(0, &[1; 8192]).unwrap();
    disk.write(5 * cs, &[1; 100]).unwrap();
    let a = all(&disk);
    disk.create_snapshot("a").unwrap();
    disk.write(4096, &[2; 8192]).unwrap();
    disk.write(9 * cs, &[2; 100]).unwrap();
    let b = all(&disk);
    disk.create_snapshot("b").unwrap();
    disk.write(0, &[3; 100]).unwrap();
    let c = all(&disk);
    let listed = disk.snapshot_list();
    assert_eq!(names(&disk), ["a", "b"]);
    assert_eq!((listed[0].id.as_str(), listed[1].id.as_str()), ("1", "2"));
    assert!(listed[1].date_sec > 1_700_000_000);
    disk.flush().unwrap();
    drop(disk);
    let mut disk = open(&storage, true);
    same(&all(&disk), &c, "reopened");
    assert_eq!(names(&disk), ["a", "b"]);
    // Apply by id: back to b, then write on; nothing of c is left.
    disk.apply_snapshot("2").unwrap();
    same(&all(&disk), &b, "applied b");
    assert_eq!(names(&disk), ["a", "b"]);
    disk.write(11 * cs, &[4; 10]).unwrap();
    // Apply by name: back to a; b goes with what followed it, and the file is cut there.
    disk.apply_snapshot("a").unwrap();
    same(&all(&disk), &a, "applied a");
    assert_eq!(names(&disk), ["a"]);
    let cut = len(&storage);
    assert_eq!(cut, disk.state().end * cs);
    assert!(disk.apply_snapshot("b").is_err(), "b is gone");
    disk.write(0, &[5; 10]).unwrap();
    let mut a5 = a.clone();
    a5[..10].fill(5);
    same(&all(&disk), &a5, "written after a");
    disk.flush().unwrap();
    drop(disk);
    let mut disk = open(&storage, true);
    same(&all(&disk), &a5, "reopened after a");
    assert_eq!(names(&disk), ["a"]);
    // Delete: the list empties, the data stays, and a deleted snapshot cannot be applied.
    disk.delete_snapshot("a").unwrap();
    assert!(names(&disk).is_empty());
    same(&all(&disk), &a5, "deleted");
    assert!(disk.apply_snapshot("a").is_err());
    assert!(disk.delete_snapshot("a").is_err());
    disk.create_snapshot("c").unwrap();
    assert_eq!(disk.snapshot_list()[0].id, "2", "ids are not reused");
    drop(disk);
    let disk = open(&storage, false);
    same(&all(&disk), &a5, "reopened after c");
    assert_eq!(names(&disk), ["c"]);
    let report = disk.check_image(&mut |m| panic!("{m}")).unwrap();
    assert_eq!((report.corruptions, report.leaks), (0, 0));
}

/// Snapshots through the Driver trait, as `vdisk snapshot` calls them, on an image opened by
/// the registry.
#[test]
fn the_driver_takes_snapshots() {
    use crate::formats::{open_storage_with, Format};
    let storage = new_image(1 << 20, 4096, None);
    let pcow = Some(Format::parse("pcow").unwrap());
    let mut image = open_storage_with(storage.clone(), pcow, "d.pcow", true).unwrap();
    assert_eq!(image.format().name(), "pcow");
    image.write(0, &[1; 4096]).unwrap();
    let d = image.driver_mut();
    assert!(d.supports(crate::formats::Capability::Snapshots));
    d.snapshot_create("one").unwrap();
    d.write(0, &[2; 4096]).unwrap();
    d.snapshot_apply("one").unwrap();
    let mut buf = vec![0u8; 4096];
    d.read(0, &mut buf).unwrap();
    assert_eq!(buf, vec![1; 4096]);
    d.snapshot_delete("one").unwrap();
    assert!(d.snapshots().is_empty());
    d.close().unwrap();
    let probed = crate::formats::probe(&*storage).unwrap();
    assert_eq!(probed.name(), "pcow");
}
