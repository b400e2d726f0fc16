/*
 * vmio: the guest's I/O tool in the VM tests (crates/vdisk-cli/tests/vm.rs), built by the test
 * with `cc -static -O2` and put in the initramfs. It does what busybox cannot: write and check
 * a deterministic pattern the host generates too (vm/pattern.rs), with or without O_DIRECT,
 * and issue BLKDISCARD and BLKZEROOUT.
 *
 *   vmio write [-d] PATH SEED OFF LEN   pattern SEED over [OFF, OFF+LEN) of PATH (created)
 *   vmio check [-d] PATH SEED OFF LEN   [OFF, OFF+LEN) of PATH holds pattern SEED
 *   vmio zeros [-d] PATH OFF LEN        [OFF, OFF+LEN) of PATH reads as zeros
 *   vmio discard DEV OFF LEN            BLKDISCARD
 *   vmio zeroout DEV OFF LEN            BLKZEROOUT
 *
 * -d opens with O_DIRECT (OFF and LEN then must be multiples of the logical block size).
 * The pattern is keyed by the absolute offset, so any range can be checked on its own: the
 * 8 bytes at offset 8*i are splitmix64(SEED * 0x9e3779b97f4a7c15 ^ i), little-endian.
 * Exit status 0 on success; on failure a line on stderr naming the first bad offset.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#define CHUNK (1u << 20)

static uint64_t splitmix64(uint64_t x)
{
	uint64_t z = x + 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint8_t pattern_byte(uint64_t seed, uint64_t off)
{
	uint64_t word = splitmix64(seed * 0x9e3779b97f4a7c15ull ^ (off / 8));
	return (uint8_t)(word >> (8 * (off % 8)));
}

static void fill(uint8_t *buf, uint64_t seed, uint64_t off, size_t len)
{
	for (size_t i = 0; i < len; i++)
		buf[i] = pattern_byte(seed, off + i);
}

static void die(const char *what, const char *path)
{
	fprintf(stderr, "vmio: %s %s: %s\n", what, path, strerror(errno));
	exit(1);
}

static uint64_t number(const char *s)
{
	char *end;
	errno = 0;
	uint64_t v = strtoull(s, &end, 0);
	if (errno || *s == '\0' || *end != '\0') {
		fprintf(stderr, "vmio: not a number: %s\n", s);
		exit(2);
	}
	return v;
}

static uint8_t *buffer(void)
{
	void *p;
	/* O_DIRECT wants an aligned buffer; 4096 covers every logical block size in use. */
	if (posix_memalign(&p, 4096, CHUNK))
		die("allocating", "a buffer");
	return p;
}

/* write (seed >= 0) or check a pattern (seed >= 0) or zeros (seed < 0) */
static int run_range(const char *verb, int direct, const char *path, int64_t seed,
		     uint64_t off, uint64_t len)
{
	int writing = strcmp(verb, "write") == 0;
	int flags = (writing ? O_WRONLY | O_CREAT : O_RDONLY) | (direct ? O_DIRECT : 0);
	int fd = open(path, flags, 0644);
	if (fd < 0)
		die("opening", path);
	uint8_t *buf = buffer(), *want = buffer();
	for (uint64_t done = 0; done < len;) {
		size_t n = len - done < CHUNK ? (size_t)(len - done) : CHUNK;
		uint64_t at = off + done;
		if (seed >= 0)
			fill(want, (uint64_t)seed, at, n);
		else
			memset(want, 0, n);
		ssize_t r = writing ? pwrite(fd, want, n, (off_t)at) : pread(fd, buf, n, (off_t)at);
		if (r < 0)
			die(writing ? "writing" : "reading", path);
		if (r == 0) {
			fprintf(stderr, "vmio: %s ends at %llu, before %llu\n", path,
				(unsigned long long)at, (unsigned long long)(off + len));
			return 1;
		}
		if (!writing) {
			for (ssize_t i = 0; i < r; i++) {
				if (buf[i] != want[i]) {
					fprintf(stderr, "vmio: %s: byte at %llu is 0x%02x, not 0x%02x\n",
						path, (unsigned long long)(at + i), buf[i], want[i]);
					return 1;
				}
			}
		}
		done += (uint64_t)r;
	}
	if (close(fd))
		die("closing", path);
	return 0;
}

static int run_ioctl(unsigned long req, const char *path, uint64_t off, uint64_t len)
{
	int fd = open(path, O_WRONLY);
	if (fd < 0)
		die("opening", path);
	uint64_t range[2] = { off, len };
	if (ioctl(fd, req, range))
		die(req == BLKDISCARD ? "BLKDISCARD on" : "BLKZEROOUT on", path);
	return close(fd) ? 1 : 0;
}

int main(int argc, char **argv)
{
	if (argc < 2)
		goto usage;
	const char *verb = argv[1];
	int direct = argc > 2 && strcmp(argv[2], "-d") == 0;
	char **a = argv + 2 + direct;
	int n = argc - 2 - direct;
	if ((!strcmp(verb, "write") || !strcmp(verb, "check")) && n == 4)
		return run_range(verb, direct, a[0], (int64_t)number(a[1]), number(a[2]),
				 number(a[3]));
	if (!strcmp(verb, "zeros") && n == 3)
		return run_range(verb, direct, a[0], -1, number(a[1]), number(a[2]));
	if (!strcmp(verb, "discard") && n == 3 && !direct)
		return run_ioctl(BLKDISCARD, a[0], number(a[1]), number(a[2]));
	if (!strcmp(verb, "zeroout") && n == 3 && !direct)
		return run_ioctl(BLKZEROOUT, a[0], number(a[1]), number(a[2]));
usage:
	fprintf(stderr, "usage: vmio write|check [-d] PATH SEED OFF LEN\n"
			"       vmio zeros [-d] PATH OFF LEN\n"
			"       vmio discard|zeroout DEV OFF LEN\n");
	return 2;
}
