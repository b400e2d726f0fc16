/*
 * vdisk_pcow.h: the C ABI of vdisk's pcow mapping (crates/vdisk-pcow-ffi), libvdisk_pcow.so
 * and libvdisk_pcow.a.
 *
 * A pcow image and its base chain mapped into the process as one byte-addressable region
 * (docs/pcow-format.md, "The mapping"): absent clusters are allocated on first touch, the
 * first store into a page of a snapshot or a base image copies that 4 KiB page. Access the
 * region through plain or volatile loads and stores; a store is durable once a
 * pcow_map_persist() covering it has returned 0.
 *
 * While a map is open the image is locked as a writer locks it: vdisk and QEMU refuse to open
 * it, and pcow_map_open() refuses an image they have open.
 *
 * The faults are served in signal handlers the library installs: SIGBUS (a first touch, on the
 * faulting thread) and SIGSEGV (a copy-on-write); a handler installed after them must pass on
 * the signals it does not claim. A system call that reaches a never-touched page of the map
 * from the kernel (read(2) into it, write(2) from it, a futex on it, KVM) fails with EFAULT
 * unless the map was opened with PCOW_MAP_KERNEL_ACCESS; one that writes into a page of a
 * snapshot or a base image fails so always: touch the memory from user space first.
 *
 * Every function that can fail returns 0 or a negative errno; pcow_last_error() then gives
 * the message. No Rust panic crosses these functions (one is reported as -EIO).
 */
#ifndef VDISK_PCOW_H
#define VDISK_PCOW_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* An open mapping. */
typedef struct PcowMap pcow_map;

/* Flag of pcow_map_open(): persist with a fence only (platforms with persistent caches,
 * eADR). The image must be on a DAX file system (the mapping needs MAP_SYNC; elsewhere the
 * open fails). Without it, persistence is what the file allows: cache-line write-backs on a
 * DAX file system, msync on any other file. */
#define PCOW_MAP_FENCE_ONLY 1u

/* Flag of pcow_map_open(): first touches that come from the kernel (read(2) into the map,
 * write(2) from it, KVM) are served too, each with a hand-off to the map's thread (tens of
 * microseconds more per first touch). Without it a first touch is served on the faulting
 * thread, and a system call that reaches a never-touched page fails with EFAULT. */
#define PCOW_MAP_KERNEL_ACCESS 2u

/* Maps the pcow image at path with its base chain. On success stores the map in *out and
 * returns 0; otherwise sets *out to NULL and returns a negative errno. */
int pcow_map_open(const char *path, uint32_t flags, pcow_map **out);

/* The first byte of the disk (NULL for a NULL map). */
void *pcow_map_ptr(const pcow_map *map);

/* The disk's size in bytes (0 for a NULL map). */
size_t pcow_map_len(const pcow_map *map);

/* Makes the stores to [offset, offset + len) durable, and with them every cluster allocated
 * and page copied since the last persist (faults record them in memory only; a crash before
 * the persist reads the old content there). -EINVAL for a range past the end. */
int pcow_map_persist(const pcow_map *map, size_t offset, size_t len);

/* Persists every store, unmaps the image and frees map (NULL: nothing). Returns a negative
 * errno if the final persist failed; the map is freed either way. */
int pcow_map_close(pcow_map *map);

/* Takes snapshot name of the pcow image at path. No map of the image may be open. */
int pcow_snapshot_create(const char *path, const char *name);

/* The message of this thread's last failed call, or NULL. Valid until the next pcow_* call
 * on the same thread. */
const char *pcow_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* VDISK_PCOW_H */
