/* dsec-build-userns: exec a program as root of a new user namespace that maps only
 * unprivileged host ids (images/build_jail.py: buildah runs there, never as host root).
 *
 * usage: dsec-build-userns -r ROOT_HOST_ID -m INSIDE:OUTSIDE:COUNT [-m ...] -- PROGRAM ARGS...
 *   -r  the host id the namespace's root (0 inside) is; the first -m must map 0 to it
 *   -m  one line of the uid and gid maps (the same for both), up to 8
 *
 * Why a helper: util-linux 2.38's `unshare --map-users` writes the maps through newuidmap,
 * which allows only ranges /etc/subuid grants, and takes one range; a process cannot write its
 * own maps for ids other than its own, and execve() in a namespace whose uid 0 is not yet
 * mapped drops every capability. So: we drop to ROOT_HOST_ID (the namespace is then owned by
 * that unprivileged uid, and the kernel's per-user counts are charged to it, not to host
 * root), unshare the user namespace, and a child still host root writes our maps (a
 * privileged writer may map any ids, several ranges). Then we are uid 0 inside, with full
 * capabilities there and none on the host, and exec PROGRAM.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_LINES 8

static void die(const char *what) {
    fprintf(stderr, "dsec-build-userns: %s: %s\n", what, strerror(errno));
    exit(125);
}

static int write_file(const char *path, const char *data) {
    int f = open(path, O_WRONLY | O_CLOEXEC);
    if (f < 0) return -1;
    ssize_t n = write(f, data, strlen(data));
    close(f);
    return n == (ssize_t)strlen(data) ? 0 : -1;
}

int main(int argc, char **argv) {
    char map[MAX_LINES * 40] = "";
    unsigned long root = 0, in, out, count;
    int lines = 0, have_root = 0, i;
    for (i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--")) { i++; break; }
        if (i + 1 >= argc) { errno = EINVAL; die("option needs a value"); }
        if (!strcmp(argv[i], "-r")) { root = strtoul(argv[++i], NULL, 10); have_root = 1; }
        else if (!strcmp(argv[i], "-m")) {
            if (lines == MAX_LINES) { errno = E2BIG; die("too many -m"); }
            if (sscanf(argv[++i], "%lu:%lu:%lu", &in, &out, &count) != 3 || !count) { errno = EINVAL; die(argv[i]); }
            if (lines == 0 && (in != 0 || out != root)) { errno = EINVAL; die("the first -m must map 0 to -r"); }
            snprintf(map + strlen(map), sizeof map - strlen(map), "%lu %lu %lu\n", in, out, count);
            lines++;
        }
        else { errno = EINVAL; die(argv[i]); }
    }
    if (!have_root || !root || !lines || i >= argc) { errno = EINVAL; die("usage: -r ROOT -m IN:OUT:COUNT -- PROG ARGS"); }

    int ready[2], done[2];
    char c = 0;
    if (pipe2(ready, O_CLOEXEC) < 0 || pipe2(done, O_CLOEXEC) < 0) die("pipe");
    pid_t self = getpid(), pid = fork();
    if (pid < 0) die("fork");
    if (pid == 0) {          /* host root: write the parent's maps once it has unshared */
        char path[64];
        close(ready[1]);
        close(done[0]);
        if (read(ready[0], &c, 1) != 1) _exit(1);
        snprintf(path, sizeof path, "/proc/%d/uid_map", (int)self);
        if (write_file(path, map) < 0) { perror("dsec-build-userns: uid_map"); _exit(1); }
        snprintf(path, sizeof path, "/proc/%d/gid_map", (int)self);
        if (write_file(path, map) < 0) { perror("dsec-build-userns: gid_map"); _exit(1); }
        if (write(done[1], &c, 1) != 1) _exit(1);
        _exit(0);
    }
    close(ready[0]);
    close(done[1]);
    if (setgroups(0, NULL) < 0 || setresgid(root, root, root) < 0 || setresuid(root, root, root) < 0)
        die("drop to the namespace's root id");
    if (unshare(CLONE_NEWUSER) < 0) die("unshare(CLONE_NEWUSER)");
    if (write(ready[1], &c, 1) != 1) die("signal the helper");
    int status = 0;
    if (read(done[0], &c, 1) != 1 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status)) {
        errno = EPERM;
        die("writing the id maps");
    }
    close(ready[1]);
    close(done[0]);
    execvp(argv[i], argv + i);
    die(argv[i]);
    return 125;
}
