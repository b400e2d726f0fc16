/*
 * Maps a pcow image through libvdisk_pcow, stores a message and a counter through the pointer,
 * persists them, takes a snapshot, stores again (a 4 KiB copy on write) and closes.
 *
 *     example IMAGE
 *
 * Run by crates/vdisk-pcow-ffi/tests/c_abi.rs, which checks the bytes with the library.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "vdisk_pcow.h"

static int fail(const char *what, int rc)
{
    const char *why = pcow_last_error();
    fprintf(stderr, "%s: %d: %s\n", what, rc, why ? why : "(no message)");
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s IMAGE\n", argv[0]);
        return 2;
    }
    const char *path = argv[1];
    const char msg[] = "hello from C";
    pcow_map *map = NULL;
    int rc = pcow_map_open(path, 0, &map);
    if (rc)
        return fail("pcow_map_open", rc);
    char *disk = pcow_map_ptr(map);
    size_t len = pcow_map_len(map);
    if (!disk || len < (1 << 20))
        return fail("pcow_map_len", (int)len);
    size_t at = 3 * 65536 + 100;
    memcpy(disk + at, msg, sizeof msg);
    volatile uint64_t *last = (volatile uint64_t *)(disk + len - 8);
    *last = 0x0123456789abcdefull;
    if ((rc = pcow_map_persist(map, at, sizeof msg)) || (rc = pcow_map_persist(map, len - 8, 8)))
        return fail("pcow_map_persist", rc);
    /* A range past the end is refused, with a message. */
    rc = pcow_map_persist(map, len - 8, 16);
    if (rc == 0 || !pcow_last_error())
        return fail("pcow_map_persist past the end succeeded", rc);
    if ((rc = pcow_map_close(map)))
        return fail("pcow_map_close", rc);

    if ((rc = pcow_snapshot_create(path, "from-c")))
        return fail("pcow_snapshot_create", rc);
    if ((rc = pcow_map_open(path, 0, &map)))
        return fail("pcow_map_open again", rc);
    disk = pcow_map_ptr(map);
    if (memcmp(disk + at, msg, sizeof msg) != 0)
        return fail("the message did not survive a close", 0);
    disk[at] = 'H'; /* into the snapshot's read-only page: a copy on write */
    if ((rc = pcow_map_persist(map, at, 1)) || (rc = pcow_map_close(map)))
        return fail("persisting the copy on write", rc);
    puts("ok");
    return 0;
}
