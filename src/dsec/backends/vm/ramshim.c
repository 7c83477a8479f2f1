/* dsec QEMU RAM shim: LD_PRELOAD'ed into the QEMU of a template clone (ramshim.py).
 *
 * A clone maps its template's RAM file MAP_PRIVATE: the pages it never writes are the shared
 * page cache of that one tmpfs file. QEMU 7.2 (and later) discards guest RAM in
 * ram_block_discard_range() -- used by virtio-balloon inflation and free page reporting -- with
 * fallocate(PUNCH_HOLE) on the backing file *and then* madvise(MADV_DONTNEED). On a private
 * mapping of a shared file the hole punch zeroes the template for every other clone (and for
 * every future one): one guest could corrupt the memory of the others.
 *
 * Two interpositions, both limited to what QEMU does with guest RAM files:
 *  1. open() of the file named by DSEC_RAM_READONLY is done O_RDONLY. A private writable
 *     mapping does not need a writable fd, and the kernel then refuses fallocate() on that fd
 *     (EBADF): the template can no longer be written through this QEMU, shim or not.
 *     (ramshim.py checks /proc/<pid>/fdinfo after the launch and fails closed otherwise.)
 *  2. fallocate(PUNCH_HOLE) on a read-only fd returns 0 without doing anything, so QEMU goes
 *     on to madvise(MADV_DONTNEED): the clone's private copies of the freed pages go back to
 *     the host and the range reads the template's pages again. The guest does not care what a
 *     freed or ballooned page holds (no page poisoning in the dsec guest kernel).
 *  3. With DSEC_KSM_ALL=1 (any VM, not only clones) a constructor asks the kernel to let KSM
 *     merge every private anonymous page of this QEMU (prctl PR_SET_MEMORY_MERGE, Linux 6.4+),
 *     not only guest RAM: the TCG TLBs and code cache of idle guests are largely identical
 *     between VMs. Best effort: an older kernel refuses it and nothing changes.
 *  4. With DSEC_THP_OFF=1 a constructor turns transparent huge pages off for this QEMU
 *     (prctl PR_SET_THP_DISABLE): QEMU madvises its TCG code cache MADV_HUGEPAGE, and on a node
 *     that is itself a VM handing freed memory back to its host, each 2 MiB page first touched
 *     costs ~11 ms of CPU against ~0.4 ms for the 4 KiB pages a clone actually uses (D94).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>

#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#endif

static int env_on(const char *name)
{
	const char *v = getenv(name);
	return v != NULL && strcmp(v, "1") == 0;
}

/* items 3 and 4 above: the process-wide memory settings, before QEMU maps anything */
__attribute__((constructor)) static void memory_prctls(void)
{
	if (env_on("DSEC_KSM_ALL"))
		prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0);
	if (env_on("DSEC_THP_OFF"))
		prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);
}

static int ram_path(const char *path)
{
	const char *ro = getenv("DSEC_RAM_READONLY");
	return ro != NULL && ro[0] != '\0' && path != NULL && strcmp(path, ro) == 0;
}

static int ro_flags(const char *path, int flags)
{
	if (ram_path(path) && (flags & O_ACCMODE) != O_RDONLY)
		flags = (flags & ~(O_ACCMODE | O_CREAT | O_TRUNC | O_EXCL)) | O_RDONLY;
	return flags;
}

static mode_t mode_arg(int flags, va_list ap)
{
	/* glibc's __OPEN_NEEDS_MODE: O_TMPFILE shares its O_DIRECTORY bit, compare all of it */
	int needs = (flags & O_CREAT) != 0 || (flags & O_TMPFILE) == O_TMPFILE;
	return needs ? (mode_t)va_arg(ap, int) : 0;
}

typedef int (*openat_fn)(int, const char *, int, ...);

static int real_openat(int dirfd, const char *path, int flags, mode_t mode)
{
	static openat_fn next;
	if (next == NULL)
		next = (openat_fn)dlsym(RTLD_NEXT, "openat64");
	if (next == NULL) {
		errno = ENOSYS;
		return -1;
	}
	return next(dirfd, path, flags, mode);
}

int open64(const char *path, int flags, ...)
{
	va_list ap;
	va_start(ap, flags);
	mode_t mode = mode_arg(flags, ap);
	va_end(ap);
	return real_openat(AT_FDCWD, path, ro_flags(path, flags), mode);
}

int open(const char *path, int flags, ...)
{
	va_list ap;
	va_start(ap, flags);
	mode_t mode = mode_arg(flags, ap);
	va_end(ap);
	return real_openat(AT_FDCWD, path, ro_flags(path, flags), mode);
}

int openat64(int dirfd, const char *path, int flags, ...)
{
	va_list ap;
	va_start(ap, flags);
	mode_t mode = mode_arg(flags, ap);
	va_end(ap);
	return real_openat(dirfd, path, ro_flags(path, flags), mode);
}

int openat(int dirfd, const char *path, int flags, ...)
{
	va_list ap;
	va_start(ap, flags);
	mode_t mode = mode_arg(flags, ap);
	va_end(ap);
	return real_openat(dirfd, path, ro_flags(path, flags), mode);
}

/* _FORTIFY_SOURCE's variants (QEMU calls __open64_2 when the flags are not a constant) */
int __open64_2(const char *path, int flags)
{
	return real_openat(AT_FDCWD, path, ro_flags(path, flags), 0);
}

int __open_2(const char *path, int flags)
{
	return real_openat(AT_FDCWD, path, ro_flags(path, flags), 0);
}

typedef int (*fallocate_fn)(int, int, off_t, off_t);

static int shim_fallocate(const char *sym, int fd, int mode, off_t off, off_t len)
{
	int fl = fcntl(fd, F_GETFL);
	if ((mode & FALLOC_FL_PUNCH_HOLE) && fl >= 0 && (fl & O_ACCMODE) == O_RDONLY)
		return 0;      /* a file this QEMU may not write: nothing to punch; madvise follows */
	fallocate_fn next = (fallocate_fn)dlsym(RTLD_NEXT, sym);
	if (next == NULL) {
		errno = ENOSYS;
		return -1;
	}
	return next(fd, mode, off, len);
}

int fallocate64(int fd, int mode, off_t off, off_t len)
{
	return shim_fallocate("fallocate64", fd, mode, off, len);
}

int fallocate(int fd, int mode, off_t off, off_t len)
{
	return shim_fallocate("fallocate", fd, mode, off, len);
}
