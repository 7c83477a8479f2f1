/* dsec-nsexec: mount a sandbox's overlay rootfs inside a private mount namespace, then exec
 * the OCI runtime there.
 *
 * Why: with the overlay in the host mount namespace, every sandbox adds a host mount and
 * crun's creation rate falls with their number (host-facts: ~95/s -> ~50/s at 1,000). Mounted
 * in a throwaway private namespace, the overlay is seen only by the container (which copies
 * the namespace) and disappears with it: nothing to leak, nothing to unmount.
 *
 * usage: dsec-nsexec -o OVERLAY_OPTIONS -t TARGET [-f FD] [-u BASE -l SRC:DST ...] -- PROGRAM ARGS...
 *   -f FD  is moved to fd 3 (crun --preserve-fds 1 hands fd 3 to the container).
 *   -u BASE  the sandbox runs in a user namespace mapping ids 0..65535 to host BASE..BASE+65535
 *   -N PATH  (with -u) the user namespace is bind-mounted at PATH (an existing file) for crun
 *   -l SRC:DST  (with -u, repeated) an idmapped clone of the layer mount SRC is attached at DST
 *            (inside the private namespace only); the overlay options name DST as lowerdir.
 *   -s DISK:SRC:DST  (with -u, repeated) the same for a directory whose files carry another
 *            sandbox's host ids DISK..DISK+65535 (a fork's view of its parent's writable layer,
 *            a btrfs snapshot): mapped DISK+n -> BASE+n, so no chown pass is needed.
 *   -v SRC:DST  (with -u, repeated) the same for a volume directory, also nosuid: crun binds
 *            DST into the sandbox (its own bind options do not carry nosuid here).
 *
 * Why idmapped lowers: the EROFS layers store host ids (root = 0). Through a mount idmapped
 * with the sandbox's mapping, disk uid 0 reads as host BASE, i.e. root inside the sandbox's
 * user namespace, so the image looks unchanged inside and copy-up keeps ownership shifted into
 * the sandbox's range. One EROFS mount (one page cache) still backs every sandbox: an idmapped
 * mount is a new vfsmount of the same superblock, not a copy.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

/* The new mount API, spelled out: musl ships no kernel headers. Syscall numbers >= 424 are the
 * same on every architecture. */
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#define DSEC_OPEN_TREE_CLONE 1
#define DSEC_MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#define DSEC_MOUNT_ATTR_NOSUID 0x00000002
#define DSEC_MOUNT_ATTR_NODEV 0x00000004
#define DSEC_MOUNT_ATTR_IDMAP 0x00100000
struct dsec_mount_attr { unsigned long long attr_set, attr_clr, propagation, userns_fd; };

#define MAX_LOWERS 256
#define ID_RANGE 65536

static void die(const char *what) {
    fprintf(stderr, "dsec-nsexec: %s: %s\n", what, strerror(errno));
    exit(125);
}

static void write_file(const char *path, const char *data) {
    int f = open(path, O_WRONLY | O_CLOEXEC);
    if (f < 0 || write(f, data, strlen(data)) != (ssize_t)strlen(data)) die(path);
    close(f);
}

/* The sandbox's user namespace, maps "0 BASE 65536": the mapping table of the idmapped
 * mounts, and (bind-mounted at -N PATH) the namespace crun joins for the container.
 * Why we make it and not crun: the kernel charges per-user counts (inotify instances,
 * RLIMIT_NPROC, user namespaces ...) at every level up the namespace tree, and at the host
 * level to the namespace's *owner* (its creator's euid). Created by crun (host root) every
 * sandbox would share host root's counts; created by a child that first became host uid BASE
 * (root of the sandbox's range), each sandbox's counts are its own.
 * The child drops to BASE, unshares and waits; we (host root) write its maps. */
static int userns_fd_map(unsigned long inside, unsigned long base) {
    int ready[2], done[2];
    char c = 0, path[64], map[64];
    if (pipe2(ready, O_CLOEXEC) < 0 || pipe2(done, O_CLOEXEC) < 0) die("pipe");
    pid_t pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
        close(ready[0]);
        close(done[1]);   /* else our own copy would keep the read below from seeing EOF */
        if (setgroups(0, NULL) < 0 || setresgid(base, base, base) < 0 || setresuid(base, base, base) < 0)
            _exit(1);
        prctl(PR_SET_DUMPABLE, 1);   /* so that its /proc files stay writable for the maps */
        if (unshare(CLONE_NEWUSER) < 0) _exit(1);
        if (write(ready[1], &c, 1) != 1) _exit(1);
        (void)!read(done[0], &c, 1);   /* hold the namespace until the parent has its fd */
        _exit(0);
    }
    close(ready[1]);
    close(done[0]);
    if (read(ready[0], &c, 1) != 1) { errno = ECHILD; die("unshare(CLONE_NEWUSER) in helper"); }
    snprintf(map, sizeof map, "%lu %lu %d\n", inside, base, ID_RANGE);
    snprintf(path, sizeof path, "/proc/%d/uid_map", (int)pid);
    write_file(path, map);
    snprintf(path, sizeof path, "/proc/%d/gid_map", (int)pid);
    write_file(path, map);
    snprintf(path, sizeof path, "/proc/%d/ns/user", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) die(path);
    close(done[1]);
    waitpid(pid, NULL, 0);
    close(ready[0]);
    return fd;
}

static int userns_fd(unsigned long base) { return userns_fd_map(0, base); }

/* Attach an idmapped clone of the mount at src on dst (new mount API, kernel >= 5.12 and a
 * filesystem that allows idmapping: erofs does on 6.x). */
static void idmap_mount(const char *src, const char *dst, int ns, unsigned long long extra) {
    int t = (int)syscall(SYS_open_tree, AT_FDCWD, src, DSEC_OPEN_TREE_CLONE | O_CLOEXEC);
    if (t < 0) die("open_tree(lower)");
    struct dsec_mount_attr attr = { .attr_set = DSEC_MOUNT_ATTR_IDMAP | DSEC_MOUNT_ATTR_NODEV | extra, .userns_fd = (unsigned long long)ns };
    if (syscall(SYS_mount_setattr, t, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0)
        die("mount_setattr(MOUNT_ATTR_IDMAP) of a lower layer (kernel or filesystem without idmapped "
            "mounts: set DSEC_USERNS=0)");
    if (syscall(SYS_move_mount, t, "", AT_FDCWD, dst, DSEC_MOVE_MOUNT_F_EMPTY_PATH) < 0) die("move_mount(lower)");
    close(t);
}

int main(int argc, char **argv) {
    const char *opts = NULL, *target = NULL, *nspath = NULL;
    char *lowers[MAX_LOWERS], *shifted[MAX_LOWERS];
    int volume[MAX_LOWERS];          /* -v: nosuid too */
    int nlowers = 0, nshifted = 0;
    unsigned long base = 0;
    int fd = -1, i, userns = 0;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--")) { i++; break; }
        if (i + 1 >= argc) { errno = EINVAL; die("option needs a value"); }
        if (!strcmp(argv[i], "-o")) opts = argv[++i];
        else if (!strcmp(argv[i], "-t")) target = argv[++i];
        else if (!strcmp(argv[i], "-f")) fd = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-N")) nspath = argv[++i];
        else if (!strcmp(argv[i], "-u")) { base = strtoul(argv[++i], NULL, 10); userns = 1; }
        else if (!strcmp(argv[i], "-l") || !strcmp(argv[i], "-v")) {
            if (nlowers == MAX_LOWERS) { errno = E2BIG; die("too many -l/-v"); }
            volume[nlowers] = argv[i][1] == 'v';
            lowers[nlowers++] = argv[++i];
        }
        else if (!strcmp(argv[i], "-s")) {
            if (nshifted == MAX_LOWERS) { errno = E2BIG; die("too many -s"); }
            shifted[nshifted++] = argv[++i];
        }
        else { errno = EINVAL; die(argv[i]); }
    }
    if (!opts || !target || i >= argc) { errno = EINVAL; die("usage: -o OPTS -t TARGET [-f FD] -- PROG ARGS"); }
    if (unshare(CLONE_NEWNS) < 0) die("unshare(CLONE_NEWNS)");
    /* keep our mounts from propagating back to the host namespace */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("make / private");
    if (userns) {
        int ns = userns_fd(base);
        for (int k = 0; k < nlowers; k++) {
            char *dst = strchr(lowers[k], ':');
            if (!dst) { errno = EINVAL; die("-l wants SRC:DST"); }
            *dst++ = 0;
            idmap_mount(lowers[k], dst, ns, volume[k] ? DSEC_MOUNT_ATTR_NOSUID : 0);
        }
        for (int k = 0; k < nshifted; k++) {
            char *src = strchr(shifted[k], ':'), *dst = src ? strchr(src + 1, ':') : NULL;
            if (!dst) { errno = EINVAL; die("-s wants DISK:SRC:DST"); }
            *src++ = 0;
            *dst++ = 0;
            int sns = userns_fd_map(strtoul(shifted[k], NULL, 10), base);
            idmap_mount(src, dst, sns, 0);
            close(sns);
        }
        if (nspath) {   /* crun joins it by path (config.json linux.namespaces user.path) */
            char src[64];
            snprintf(src, sizeof src, "/proc/self/fd/%d", ns);
            if (mount(src, nspath, NULL, MS_BIND, NULL) < 0) die("bind-mount the user namespace");
        }
        close(ns);
    }
    if (mount("overlay", target, "overlay", MS_NODEV, opts) < 0) die("mount overlay");
    if (fd >= 0 && fd != 3) {
        if (dup2(fd, 3) < 0) die("dup2");
        close(fd);
    }
    if (fd >= 0) fcntl(3, F_SETFD, 0); /* must survive exec into the runtime */
    execvp(argv[i], argv + i);
    die(argv[i]);
    return 125;
}
