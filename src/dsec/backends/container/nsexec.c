/* dsec-nsexec: mount a sandbox's overlay rootfs inside a private mount namespace, then exec
 * the OCI runtime there.
 *
 * Why: with the overlay in the host mount namespace, every sandbox adds a host mount and
 * crun's creation rate falls with their number (host-facts: ~95/s -> ~50/s at 1,000). Mounted
 * in a throwaway private namespace, the overlay is seen only by the container (which copies
 * the namespace) and disappears with it: nothing to leak, nothing to unmount.
 *
 * usage: dsec-nsexec -o OVERLAY_OPTIONS -t TARGET [-f FD] -- PROGRAM ARGS...
 *   -f FD  is moved to fd 3 (crun --preserve-fds 1 hands fd 3 to the container).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <unistd.h>

static void die(const char *what) {
    fprintf(stderr, "dsec-nsexec: %s: %s\n", what, strerror(errno));
    exit(125);
}

int main(int argc, char **argv) {
    const char *opts = NULL, *target = NULL;
    int fd = -1, i;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--")) { i++; break; }
        if (i + 1 >= argc) { errno = EINVAL; die("option needs a value"); }
        if (!strcmp(argv[i], "-o")) opts = argv[++i];
        else if (!strcmp(argv[i], "-t")) target = argv[++i];
        else if (!strcmp(argv[i], "-f")) fd = atoi(argv[++i]);
        else { errno = EINVAL; die(argv[i]); }
    }
    if (!opts || !target || i >= argc) { errno = EINVAL; die("usage: -o OPTS -t TARGET [-f FD] -- PROG ARGS"); }
    if (unshare(CLONE_NEWNS) < 0) die("unshare(CLONE_NEWNS)");
    /* keep our mounts from propagating back to the host namespace */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("make / private");
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
