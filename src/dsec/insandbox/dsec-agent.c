/*
 * dsec-agent: the in-sandbox agent, PID 1 of every container sandbox.
 *
 * Contract: docs/agent-protocol.md. In short: one AF_UNIX connection at a time (a new one
 * replaces the old), length-prefixed frames, commands run through `shell -c`, persistent
 * shell sessions, and file operations done with the sandbox user's filesystem ids.
 *
 * Design:
 *  - Single-threaded poll() loop over the listening socket, the edge connection, a signalfd
 *    (SIGCHLD, SIGTERM, SIGINT) and the fds of every running command. Timers come from the
 *    nearest deadline; nothing in the loop blocks on untrusted parties.
 *  - Every command runs under a supervisor S: this same binary re-executed with
 *    `--supervise` (a fresh, tiny image rather than a fork of the agent, so a long-lived S
 *    does not pin the agent's heap). S is a child subreaper, so everything the command
 *    starts (even after setsid()) stays below S and a timeout can kill the whole tree.
 *    S reports the command's pid, start-up errors and wait status over a SEQPACKET socket.
 *  - Bounded memory everywhere: frame size, per-stream output caps, a retained-exec limit
 *    (count and bytes), a paced outgoing queue (dropped beyond OUTQ_DROP), bounded stdin
 *    queues, bounded listings.
 *  - Malformed input never crashes the agent: a bad frame is answered with ERROR, an
 *    unparseable stream (oversize length) drops the connection.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

/* ------------------------------------------------------------------ limits */

#define HDR 12u
#define PROTO_VERSION 2u      /* 2: per-exec output credit (CREDIT, WINDOW) */
#define MAX_PAYLOAD ((64u << 20) + 4096u) /* largest frame payload accepted */
#define OUTQ_DROP (8u << 20)      /* edge not reading: drop the connection */
#define OUTQ_PACE (1u << 20)      /* bulk producers only fill the queue up to here */
#define BQ_KEEP (256u << 10)      /* larger idle buffers are freed */
#define FRAME_CHUNK (256u << 10)  /* max STDOUT/STDERR frame payload */
#define FILE_CHUNK (1u << 20)     /* max DATA frame payload */
#define READ_CHUNK (64u << 10)    /* one read() from a command pipe */
#define DEFAULT_CAP (1u << 20)
#define MAX_CAP (64u << 20)
#define DEFAULT_MAXLEN (64u << 20)
#define MAX_FINISHED 64           /* finished, unreleased execs retained */
#define MAX_FINISHED_BYTES (64u << 20) /* default of -R */
#define MAX_RUNNING 128           /* <= 4 fds each; with sessions and readers */
#define MAX_SESSIONS 32           /* everything fits a 1024 fd limit */
#define MAX_READERS 64
#define MAX_NAME 256
#define MAX_ENV 4096
#define STDIN_QMAX ((size_t)MAX_PAYLOAD * 2)
#define CHECK_KEEP (64u << 10)    /* syntax-check output kept per stream */
#define LISTING_MAX (8u << 20)
#define LINGER_MS 100             /* after the command exited, wait this long for pipe EOF */
#define KILL_GRACE_MS 2000        /* after a kill request, give up waiting for the status */
#define MAX_WATCHES 16            /* WATCH streams at once (one inotify instance each) */
#define WATCH_DIRS_MAX 8192       /* directories one recursive WATCH follows */
#define WATCH_OUT_MAX (1u << 20)  /* queued output beyond which events wait in the kernel */
#define WATCH_FOUND_MAX (256u << 10) /* reports of what a new directory already held, per read */

enum {
	T_EXEC = 1, T_STDIN, T_SIGNAL, T_RELEASE, T_ATTACH, T_FILE_READ, T_FILE_WRITE, T_LIST,
	T_PING, T_SESSION_CLOSE, T_LIST_EXECS, T_REMOVE, T_MKDIR, T_REFRESH, T_WATCH, T_UNWATCH,
	T_CREDIT,
	T_STDOUT = 101, T_STDERR, T_EXIT, T_ERROR, T_DATA, T_OK, T_LISTING, T_PONG, T_EXECS, T_EVENT,
};

enum {
	F_CMD = 1, F_CWD, F_ENV, F_UID, F_GID, F_TIMEOUT_MS, F_CAP, F_SESSION, F_STDIN, F_PATH,
	F_DATA, F_MODE, F_MKDIRS, F_MAXLEN, F_KEEP_STDIN, F_TIME_NS, F_RECURSIVE, F_WINDOW, F_MAX
};

/* supervisor -> agent messages (SEQPACKET, one struct each) */
enum { SM_PID = 1, SM_STARTERR = 2, SM_STATUS = 3 };
struct smsg { int32_t type, a, b; };

/* start-up stages of the command, for error messages */
enum { ST_FORK = 1, ST_SETSID, ST_SETGROUPS, ST_SETGID, ST_SETUID, ST_CHDIR, ST_EXEC, ST_SUPERVISOR,
       ST_RLIMIT, ST_LANDLOCK };
static const char *stage_name(int s)
{
	static const char *n[] = { "start", "fork", "setsid", "setgroups", "setgid", "setuid",
				   "chdir", "execve", "supervisor", "setrlimit", "landlock" };
	return (s >= 0 && s <= ST_LANDLOCK) ? n[s] : "start";
}

/* ------------------------------------------------------------------ small helpers */

static void put16(uint8_t *p, uint16_t v) { p[0] = v; p[1] = v >> 8; }
static void put32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = v >> (8 * i); }
static void put64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = v >> (8 * i); }
static uint32_t get32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32; }

static int64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void set_nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }
static void xclose(int *fd) { if (*fd >= 0) { close(*fd); *fd = -1; } }

/* Mark every fd >= 3 close-on-exec (close_range needs Linux 5.11; fall back to /proc). */
static void cloexec_from3(void)
{
#ifdef SYS_close_range
	if (syscall(SYS_close_range, 3u, ~0u, 4u /* CLOSE_RANGE_CLOEXEC */) == 0)
		return;
#endif
	DIR *d = opendir("/proc/self/fd");
	if (!d)
		return;
	struct dirent *de;
	while ((de = readdir(d))) {
		int fd = atoi(de->d_name);
		if (fd >= 3 && fd != dirfd(d))
			fcntl(fd, F_SETFD, FD_CLOEXEC);
	}
	closedir(d);
}

static void random_hex(char *out, size_t nbytes)
{
	static uint64_t ctr;
	unsigned char b[32];
	if (nbytes > sizeof b)
		nbytes = sizeof b;
	long r = syscall(SYS_getrandom, b, nbytes, 0x1 /* GRND_NONBLOCK */);
	if (r != (long)nbytes) { /* no entropy yet: uniqueness is all we need */
		uint64_t x = (uint64_t)now_ms() * 6364136223846793005ull ^ (uint64_t)getpid() << 32 ^ ++ctr;
		for (size_t i = 0; i < nbytes; i++) { x = x * 6364136223846793005ull + 1442695040888963407ull; b[i] = x >> 56; }
	}
	for (size_t i = 0; i < nbytes; i++) {
		out[2 * i] = "0123456789abcdef"[b[i] >> 4];
		out[2 * i + 1] = "0123456789abcdef"[b[i] & 15];
	}
	out[2 * nbytes] = 0;
}

/* Growable byte queue: data lives at p[off .. off+len). */
struct bq { char *p; size_t off, len, cap; };

static int bq_reserve(struct bq *q, size_t n)
{
	if (q->off + q->len + n <= q->cap)
		return 0;
	if (q->off) { /* reclaim consumed space before growing */
		memmove(q->p, q->p + q->off, q->len);
		q->off = 0;
		if (q->len + n <= q->cap)
			return 0;
	}
	size_t want = q->cap + q->cap / 2;
	if (want < q->len + n)
		want = q->len + n;
	if (want < 4096)
		want = 4096;
	char *np = realloc(q->p, want);
	if (!np)
		return -1;
	q->p = np;
	q->cap = want;
	return 0;
}
static int bq_append(struct bq *q, const void *d, size_t n)
{
	if (bq_reserve(q, n) < 0)
		return -1;
	memcpy(q->p + q->off + q->len, d, n);
	q->len += n;
	return 0;
}
static void bq_consume(struct bq *q, size_t n)
{
	q->off += n;
	q->len -= n;
	if (!q->len)
		q->off = 0;
}
static void bq_free(struct bq *q) { free(q->p); memset(q, 0, sizeof *q); }
static void bq_trim(struct bq *q) { if (!q->len && q->cap > BQ_KEEP) bq_free(q); }

/* Retained output: grows up to a limit, never beyond. */
struct rbuf { char *p; size_t len, alloc; };

static size_t rbuf_add(struct rbuf *b, const char *d, size_t n, size_t limit)
{
	if (b->len >= limit)
		return 0;
	if (n > limit - b->len)
		n = limit - b->len;
	if (b->len + n > b->alloc) {
		size_t want = b->alloc ? b->alloc * 2 : 4096;
		if (want < b->len + n)
			want = b->len + n;
		if (want > limit)
			want = limit;
		char *np = realloc(b->p, want);
		if (!np)
			return 0;
		b->p = np;
		b->alloc = want;
	}
	memcpy(b->p + b->len, d, n);
	b->len += n;
	return n;
}
static void rbuf_free(struct rbuf *b) { free(b->p); memset(b, 0, sizeof *b); }

/* ------------------------------------------------------------------ Landlock
 *
 * Every command, session shell and syntax check gets its own Landlock domain, created in the
 * forked child right before execve (so each exec/session is a separate domain). Two effects:
 *  - filesystem: what root inside the sandbox may still not do (table below);
 *  - ptrace scoping, which Landlock applies to every domain: a process may only ptrace-access
 *    (and so read /proc/PID/{fd,environ,mem,...}) processes in its own domain or below it. A
 *    command therefore cannot open another command's or session's pipes through
 *    /proc/PID/fd (steal its output, inject into its stdin), read its environment or memory,
 *    and cannot touch the agent or the supervisors at all (they are in no domain).
 * Reads are not handled (allowed); masked /proc paths are the runtime's job (spec.py).
 * Landlock grants on hierarchies and cannot subtract, so the sandbox's own tree is granted
 * entry by entry: every top-level entry of / that exists when the command starts, except
 * LL_DENY_TOP. Consequence: a command cannot create, remove or rename an entry directly in /
 * (that would need a grant on / itself, which covers /proc and /dev); new top-level
 * directories come from the image or the files API (the agent is not confined) and are
 * writable for every command started after they appear. Symlinks at the top level are
 * skipped (never followed: `/x -> /proc` must not grant /proc).
 * Rights are masked by the kernel's ABI; below ABI 2 Landlock is not used at all (ABI 1
 * forbids every cross-directory rename/link, which breaks ordinary tools).
 */
#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#endif
#ifndef SYS_landlock_add_rule
#define SYS_landlock_add_rule 445
#endif
#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif
#define LL_CREATE_RULESET_VERSION (1u << 0)
#define LL_RULE_PATH_BENEATH 1
#define LL_EXECUTE      (1ull << 0)
#define LL_WRITE_FILE   (1ull << 1)
#define LL_REMOVE_DIR   (1ull << 4)
#define LL_REMOVE_FILE  (1ull << 5)
#define LL_MAKE_CHAR    (1ull << 6)
#define LL_MAKE_DIR     (1ull << 7)
#define LL_MAKE_REG     (1ull << 8)
#define LL_MAKE_SOCK    (1ull << 9)
#define LL_MAKE_FIFO    (1ull << 10)
#define LL_MAKE_BLOCK   (1ull << 11)
#define LL_MAKE_SYM     (1ull << 12)
#define LL_REFER        (1ull << 13)  /* ABI 2 */
#define LL_TRUNCATE     (1ull << 14)  /* ABI 3 */
#define LL_IOCTL_DEV    (1ull << 15)  /* ABI 5 */
#define LL_MIN_ABI 2

struct ll_ruleset_attr { uint64_t handled_access_fs, handled_access_net, scoped; };
struct __attribute__((packed)) ll_path_beneath { uint64_t allowed_access; int32_t parent_fd; };

/* groups of rights */
#define LL_WFILE (LL_WRITE_FILE | LL_TRUNCATE)
#define LL_WDIR  (LL_REMOVE_DIR | LL_REMOVE_FILE | LL_MAKE_DIR | LL_MAKE_REG | LL_MAKE_SOCK | \
		  LL_MAKE_FIFO | LL_MAKE_SYM | LL_REFER)       /* never MAKE_CHAR / MAKE_BLOCK */
#define LL_TREE  (LL_EXECUTE | LL_WFILE | LL_WDIR)              /* the sandbox's own tree */
#define LL_FILE_ONLY (LL_EXECUTE | LL_WRITE_FILE | LL_TRUNCATE | LL_IOCTL_DEV) /* rights a file can carry */

/* Top-level entries of / that get nothing: no write, no execute, no device ioctls. */
static const char *const LL_DENY_TOP[] = { "proc", "sys", "dev", ".dsec" };

/* Exceptions below the denied entries (paths are never followed if they are symlinks). */
static const struct { const char *path; uint64_t access; } LL_RULES[] = {
	{ "/dev/null",    LL_WFILE | LL_IOCTL_DEV },
	{ "/dev/zero",    LL_WFILE },
	{ "/dev/full",    LL_WFILE },
	{ "/dev/random",  LL_WFILE },
	{ "/dev/urandom", LL_WFILE },
	{ "/dev/tty",     LL_WFILE | LL_IOCTL_DEV },
	{ "/dev/pts",     LL_WFILE | LL_IOCTL_DEV },        /* ptys (in containers /dev/ptmx -> pts/ptmx) */
	{ "/dev/ptmx",    LL_WFILE | LL_IOCTL_DEV },        /* where it is a device node instead */
	{ "/dev/shm",     LL_WFILE | LL_WDIR },             /* POSIX shm, semaphores: no execute */
	{ "/dev/mqueue",  LL_WFILE | LL_WDIR },
};

/* The kernel's Landlock ABI version, 0 if Landlock is unavailable (or disabled). */
static int ll_probe(void)
{
	long v = syscall(SYS_landlock_create_ruleset, NULL, 0, LL_CREATE_RULESET_VERSION);
	return v > 0 ? (int)v : 0;
}

static uint64_t ll_handled(int abi)
{
	uint64_t h = LL_EXECUTE | LL_WRITE_FILE | LL_REMOVE_DIR | LL_REMOVE_FILE | LL_MAKE_CHAR |
		     LL_MAKE_DIR | LL_MAKE_REG | LL_MAKE_SOCK | LL_MAKE_FIFO | LL_MAKE_BLOCK | LL_MAKE_SYM;
	if (abi >= 2)
		h |= LL_REFER;
	if (abi >= 3)
		h |= LL_TRUNCATE;
	if (abi >= 5)
		h |= LL_IOCTL_DEV;
	return h;
}

static void ll_add(int rs, int dfd, const char *name, unsigned char dtype, uint64_t access)
{
	if (dtype == DT_LNK)
		return;
	int fd = openat(dfd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
	struct stat st;
	if (fd < 0)
		return;
	if (dtype == DT_UNKNOWN) /* readdir could not tell: ask */
		dtype = fstat(fd, &st) < 0 ? DT_LNK : S_ISLNK(st.st_mode) ? DT_LNK : S_ISDIR(st.st_mode) ? DT_DIR : DT_REG;
	if (dtype != DT_DIR)
		access &= LL_FILE_ONLY;
	struct ll_path_beneath pb = { access, fd };
	if (access && dtype != DT_LNK) /* failures (odd filesystems) only mean: no grant there */
		syscall(SYS_landlock_add_rule, rs, LL_RULE_PATH_BENEATH, &pb, 0);
	close(fd);
}

/* The ruleset of the sandbox's current top level, as an fd (O_CLOEXEC), or -1 with errno. */
static int ll_build(int abi)
{
	uint64_t h = ll_handled(abi);
	struct ll_ruleset_attr ra = { .handled_access_fs = h };
	int rs = (int)syscall(SYS_landlock_create_ruleset, &ra, sizeof ra, 0);
	if (rs < 0)
		return -1;
	DIR *d = opendir("/");
	struct dirent *de;
	while (d && (de = readdir(d))) {
		const char *nm = de->d_name;
		int skip = !strcmp(nm, ".") || !strcmp(nm, "..");
		for (size_t i = 0; !skip && i < sizeof LL_DENY_TOP / sizeof *LL_DENY_TOP; i++)
			skip = !strcmp(nm, LL_DENY_TOP[i]);
		if (!skip)
			ll_add(rs, dirfd(d), nm, de->d_type, LL_TREE & h);
	}
	if (d)
		closedir(d);
	for (size_t i = 0; i < sizeof LL_RULES / sizeof *LL_RULES; i++)
		ll_add(rs, AT_FDCWD, LL_RULES[i].path, DT_UNKNOWN, LL_RULES[i].access & h);
	return rs;
}

/*
 * The agent keeps one ruleset and rebuilds it only when / changed (its mtime moves whenever
 * a top-level entry is created, removed or renamed): building costs ~120 us (an open and a
 * landlock_add_rule per top-level entry), enforcing a ready ruleset a few us. Every
 * landlock_restrict_self() creates a new domain, so sharing the ruleset does not share
 * domains: each command and session is still alone in its own.
 */
static struct { int fd; struct timespec mtime; ino_t ino; } LL = { -1, { 0, 0 }, 0 };

static int ll_ruleset(int abi)
{
	struct stat st;
	if (stat("/", &st) < 0)
		return -1;
	if (LL.fd >= 0 && st.st_ino == LL.ino && st.st_mtim.tv_sec == LL.mtime.tv_sec &&
	    st.st_mtim.tv_nsec == LL.mtime.tv_nsec)
		return LL.fd;
	int fd = ll_build(abi);
	if (fd < 0)
		return -1;
	if (fd < 10) { /* never one of the fds a supervisor gets (0..4): keeps dup2 plain */
		int hi = fcntl(fd, F_DUPFD_CLOEXEC, 10);
		close(fd);
		if ((fd = hi) < 0)
			return -1;
	}
	if (LL.fd >= 0)
		close(LL.fd);
	LL.fd = fd;
	LL.mtime = st.st_mtim;
	LL.ino = st.st_ino;
	return fd;
}

/* In the command's process, before execve: enter a new domain of ruleset `rs`. */
static int ll_enforce(int rs)
{
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		return -1;
	return syscall(SYS_landlock_restrict_self, rs, 0) < 0 ? -1 : 0;
}

/* ------------------------------------------------------------------ state */

enum { PK_EXEC, PK_CHECK, PK_SESSION };   /* what a supervised process is for */
enum { PH_CHECK, PH_RUN, PH_DONE };       /* exec phases (PH_CHECK: session syntax check) */

struct proc {                 /* one supervised command: S + C and the agent's ends of its fds */
	struct proc *next;
	int kind;
	void *owner;              /* struct exec * or struct session *; NULL when orphaned */
	int ctl, out[2], in;      /* -1 when closed */
	struct bq inq;            /* bytes waiting for C's stdin */
	int in_close;             /* close stdin once inq is drained */
	pid_t cpid;               /* C's pid == its process group; 0 until S reports it */
	int status, have_status;  /* C's wait status */
	int start_err, start_stage;
	int pending_sig;          /* SIGNAL that arrived before the pid was known */
	int kill_sent;
	int64_t exited_at, kill_deadline;
	int zombie;               /* finished; freed at the end of the loop iteration */
};

struct session;

struct exec {
	struct exec *next;
	uint32_t chan;
	int phase;
	struct session *sess;
	struct proc *proc;        /* plain exec: the command; session exec: the syntax check */
	int64_t deadline;         /* 0 = no timeout */
	uint32_t cap;
	struct rbuf out[2];       /* retained copy (<= cap) of stdout/stderr */
	uint64_t total[2];
	size_t sent[2];           /* bytes of out[] already queued to the current connection */
	uint64_t gen;             /* == G.gen: output goes to the current connection */
	int64_t credit;           /* output bytes the edge still takes on this chan; -1: no flow control */
	int exit_sent, auto_release, timed_out, truncated, session_ended;
	int failed_err, failed_stage;
	int exit_code, sig;
	uint64_t seq;             /* finish order, for eviction */
	char *cwd;
	/* session exec: kept until the syntax check passed */
	char *script;
	size_t script_len;
	char **env;
	uid_t uid;
	gid_t gid;
	struct rbuf chk[2];
	char marker[32];
};

struct session {
	struct session *next;
	char *name;
	char shell_path[PATH_MAX];
	struct proc *shell;
	struct exec *cur;         /* busy while non-NULL */
	int closing;
	char marker[32];
	size_t mlen;
	char hold[2][64];         /* tail that may be the start of a marker */
	size_t hlen[2];
	int seen[2], code;
};

struct freader {              /* FILE_READ streamed at the pace the edge reads */
	struct freader *next;
	uint32_t chan;
	int fd;
	uint64_t sent, maxlen, gen;
};

struct wdir { int wd; char *rel; };  /* one watched directory, named relative to the root */
struct watch {                /* WATCH: inotify events of a directory (tree) streamed on a chan */
	struct watch *next;
	uint32_t chan;
	uint64_t gen;
	int ifd, root_wd, recursive, ended; /* ended: an errno to report, the watch is over */
	char *path;               /* the watched directory: reopened (and checked) to follow new ones */
	dev_t dev;                /* ... its identity: no fd is kept, an open one would stop */
	ino_t ino;                /* the kernel reporting the directory's removal */
	uid_t uid;
	gid_t gid;
	struct wdir *dirs;        /* sorted by wd */
	size_t ndirs, cap;
};

enum { SL_SIG, SL_LISTEN, SL_CONN, SL_CTL, SL_OUT0, SL_OUT1, SL_IN, SL_DEV, SL_WATCH };
/* Device mode (-D): the host side of the port is away (probe it now and then) or the
 * connection was dropped by us and its remaining input is discarded until the host hangs up. */
enum { DS_AWAY, DS_DRAIN };
#define DEV_BACKOFF_MAX 64 /* ms between probes of an absent host (SIGIO usually wakes us first) */
struct slot { int kind; struct proc *p; struct watch *w; };

static struct {
	const char *workdir, *shell, *self, *self_alt; /* self_alt: argv[0], if /proc is unusable */
	uid_t uid;
	gid_t gid;
	int ll_abi;               /* Landlock ABI applied to commands; 0: none */
	unsigned long nofile;     /* RLIMIT_NOFILE of commands (soft = hard); 0: inherited */
	unsigned long long fsize; /* RLIMIT_FSIZE of commands in bytes; 0: unlimited */
	int lfd, conn, sfd, dispatching;
	uint64_t gen, seq;
	size_t retain_max;        /* -R: output bytes of finished, unreleased execs kept at most */
	int evict_due;            /* an EXIT went out: its exec may be evicted (exec_evict) */
	struct bq in, out;
	struct proc *procs;
	struct exec *execs;
	struct session *sessions;
	struct freader *readers;
	struct watch *watches;
	int running, nsessions, nreaders, nwatches;
	int64_t accept_pause;     /* out of fds: stop polling the listener until then */
	const char *dev;          /* -D: virtio-serial port used instead of a listening socket */
	int dfd, dstate, dev_eof, dev_backoff;
	int64_t dev_retry;        /* DS_AWAY: next probe of the host side */
	struct pollfd *pfd;
	struct slot *slot;
	size_t pcap;
} G = { .workdir = "/", .lfd = 3, .conn = -1, .sfd = -1, .gen = 1, .ll_abi = -1, .nofile = 4096,
	.dfd = -1, .dev_backoff = 1, .retain_max = MAX_FINISHED_BYTES };

static char scratch[READ_CHUNK];
static char combine[READ_CHUNK + 128];

/* ------------------------------------------------------------------ connection output */

/* Device mode: the port stays open; SIGIO (O_ASYNC) tells us when the host side reconnects. */
static void dev_detach(int state)
{
	G.dstate = state;
	G.dev_retry = 0;
	G.dev_backoff = 1;
	fcntl(G.dfd, F_SETFL, fcntl(G.dfd, F_GETFL) | O_ASYNC);
}

static void conn_close(void)
{
	if (G.conn < 0)
		return;
	if (G.conn == G.dfd) /* EOF: the host left; otherwise we dropped it: discard until it leaves */
		dev_detach(G.dev_eof ? DS_AWAY : DS_DRAIN);
	else
		close(G.conn);
	G.dev_eof = 0;
	G.conn = -1;
	G.gen++;                  /* detaches every exec and file reader */
	bq_free(&G.out);
	if (!G.dispatching)       /* frame handlers may still point into the input buffer */
		bq_free(&G.in);
}

static void put_hdr(uint8_t *w, uint32_t len, int type, uint32_t chan)
{
	put32(w, len);
	w[4] = (uint8_t)type;
	w[5] = 0;
	put16(w + 6, 0);
	put32(w + 8, chan);
}

static int out_frame(int type, uint32_t chan, const void *a, size_t alen, const void *b, size_t blen)
{
	if (G.conn < 0)
		return -1;
	if (G.out.len > OUTQ_DROP) { /* the edge stopped reading; it can re-ATTACH later */
		conn_close();
		return -1;
	}
	if (bq_reserve(&G.out, HDR + alen + blen) < 0) {
		conn_close();
		return -1;
	}
	uint8_t *w = (uint8_t *)G.out.p + G.out.off + G.out.len;
	put_hdr(w, (uint32_t)(alen + blen), type, chan);
	if (alen)
		memcpy(w + HDR, a, alen);
	if (blen)
		memcpy(w + HDR + alen, b, blen);
	G.out.len += HDR + alen + blen;
	return 0;
}

static void send_err(uint32_t chan, int err, const char *fmt, ...)
{
	char msg[600];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	if (n < 0)
		n = 0;
	if ((size_t)n >= sizeof msg)
		n = sizeof msg - 1;
	uint8_t e[4];
	put32(e, (uint32_t)err);
	out_frame(T_ERROR, chan, e, 4, msg, (size_t)n);
}

static void send_ok(uint32_t chan) { out_frame(T_OK, chan, NULL, 0, NULL, 0); }

static void conn_flush(void)
{
	while (G.conn >= 0 && G.out.len) {
		ssize_t n = G.conn == G.dfd ? write(G.conn, G.out.p + G.out.off, G.out.len)
			: send(G.conn, G.out.p + G.out.off, G.out.len, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (n > 0) {
			bq_consume(&G.out, (size_t)n);
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			break;
		conn_close();
		return;
	}
	bq_trim(&G.out);
}

/* ------------------------------------------------------------------ execs: output & retention */

static int attached(const struct exec *e) { return G.conn >= 0 && e->gen == G.gen; }

static struct exec *exec_find(uint32_t chan)
{
	for (struct exec *e = G.execs; e; e = e->next)
		if (e->chan == chan)
			return e;
	return NULL;
}

static void free_strv(char **v)
{
	free(v); /* pointer array and strings are one allocation */
}

static void exec_free(struct exec *e)
{
	for (struct exec **pp = &G.execs; *pp; pp = &(*pp)->next)
		if (*pp == e) {
			*pp = e->next;
			break;
		}
	for (int i = 0; i < 2; i++) {
		rbuf_free(&e->out[i]);
		rbuf_free(&e->chk[i]);
	}
	free(e->cwd);
	free(e->script);
	free_strv(e->env);
	free(e);
}

/* Output of a running exec: counted always, retained and forwarded up to CAP. */
static void exec_output(struct exec *e, int st, const char *d, size_t n)
{
	e->total[st] += n;
	if (rbuf_add(&e->out[st], d, n, e->cap) < n)
		e->truncated = 1;
}

/*
 * Drop finished execs beyond the count and byte budgets (MAX_FINISHED, -R), oldest first:
 * first those whose EXIT went out (the edge has the result and should have sent RELEASE),
 * then those no connection follows (an edge that restarts may still ATTACH). Never `keep`,
 * and never one whose EXIT the current connection has not been sent yet: its client is
 * waiting for that result, which would otherwise be lost (it would wait forever).
 */
static void exec_evict(struct exec *keep)
{
	for (;;) {
		int n = 0;
		size_t bytes = 0;
		struct exec *sent = NULL, *detached = NULL;
		for (struct exec *e = G.execs; e; e = e->next) {
			if (e->phase != PH_DONE)
				continue;
			n++;
			bytes += e->out[0].alloc + e->out[1].alloc;
			if (e == keep)
				continue;
			if (!attached(e)) {
				if (!detached || e->seq < detached->seq)
					detached = e;
			} else if (e->exit_sent && (!sent || e->seq < sent->seq)) {
				sent = e;
			}
		}
		struct exec *old = sent ? sent : detached;
		if (!old || (n <= MAX_FINISHED && bytes <= G.retain_max))
			return;
		exec_free(old);
	}
}

static void set_exit(struct exec *e, int status)
{
	if (WIFEXITED(status)) {
		e->exit_code = WEXITSTATUS(status);
		e->sig = 0;
	} else {
		e->exit_code = -1;
		e->sig = WIFSIGNALED(status) ? WTERMSIG(status) : SIGKILL;
	}
}

static void exec_done(struct exec *e)
{
	e->phase = PH_DONE;
	e->seq = ++G.seq;
	G.running--;
	if (e->timed_out) {
		e->exit_code = -1;
		e->sig = SIGKILL;
	}
	free(e->script);
	e->script = NULL;
	free_strv(e->env);
	e->env = NULL;
	rbuf_free(&e->chk[0]);
	rbuf_free(&e->chk[1]);
	for (int st = 0; st < 2; st++) { /* retained for a while: give back the slack */
		struct rbuf *r = &e->out[st];
		char *np;
		if (!r->len)
			rbuf_free(r);
		else if (r->alloc > r->len && (np = realloc(r->p, r->len))) {
			r->p = np;
			r->alloc = r->len;
		}
	}
	if (e->failed_err) { /* the command never ran: answer ERROR, keep nothing */
		if (attached(e))
			send_err(e->chan, e->failed_err, "%s%s%s: %s", stage_name(e->failed_stage),
				 e->failed_stage == ST_CHDIR ? " " : "", e->failed_stage == ST_CHDIR ? (e->cwd ? e->cwd : G.workdir) : "",
				 strerror(e->failed_err));
		exec_free(e);
		return;
	}
	if (e->auto_release && !attached(e)) {
		exec_free(e);
		return;
	}
	exec_evict(e);
}

static void send_exit(struct exec *e)
{
	uint8_t b[28];
	put32(b, (uint32_t)e->exit_code);
	put32(b + 4, (uint32_t)e->sig);
	b[8] = (uint8_t)e->timed_out;
	b[9] = (uint8_t)e->truncated;
	b[10] = (uint8_t)e->session_ended;
	b[11] = 0;
	put64(b + 12, e->total[0]);
	put64(b + 20, e->total[1]);
	out_frame(T_EXIT, e->chan, b, sizeof b, NULL, 0);
}

/* Queue unsent retained output (stdout first), then EXIT. Returns 1 if `e` was freed. */
static int exec_pump(struct exec *e)
{
	if (!attached(e))
		return 0;
	for (int st = 0; st < 2; st++)
		while (e->sent[st] < e->out[st].len) {
			if (G.out.len >= OUTQ_PACE || !e->credit) /* no credit: it waits here, retained */
				return 0;
			size_t n = e->out[st].len - e->sent[st];
			if (n > FRAME_CHUNK)
				n = FRAME_CHUNK;
			if (e->credit > 0 && (int64_t)n > e->credit)
				n = (size_t)e->credit;
			if (out_frame(st ? T_STDERR : T_STDOUT, e->chan, e->out[st].p + e->sent[st], n, NULL, 0) < 0)
				return 0;
			e->sent[st] += n;
			if (e->credit > 0)
				e->credit -= (int64_t)n;
		}
	if (e->phase == PH_DONE && !e->exit_sent) {
		send_exit(e);
		e->exit_sent = 1;
		if (e->auto_release) {
			exec_free(e);
			return 1;
		}
		G.evict_due = 1; /* it may be evicted now: pump_all checks the budgets */
	}
	return 0;
}

/* ------------------------------------------------------------------ supervised processes */

static struct proc *proc_spawn(int kind, void *owner, uid_t uid, gid_t gid, const char *cwd,
			       char *const *cargv, char *const *envp, int want_in, int *err)
{
	int o[2] = { -1, -1 }, e[2] = { -1, -1 }, in[2] = { -1, -1 }, sp[2] = { -1, -1 };
	char **av = NULL;
	struct proc *p = calloc(1, sizeof *p);
	if (!p) {
		*err = ENOMEM;
		return NULL;
	}
	if (pipe2(o, O_CLOEXEC) || pipe2(e, O_CLOEXEC) || (want_in && pipe2(in, O_CLOEXEC)) ||
	    socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp)) {
		*err = errno;
		goto fail;
	}
	size_t nc = 0;
	while (cargv[nc])
		nc++;
	av = calloc(nc + 8, sizeof *av);
	if (!av) {
		*err = ENOMEM;
		goto fail;
	}
	char us[16], gs[16], ps[16], os[64];
	snprintf(us, sizeof us, "%u", (unsigned)uid);
	snprintf(gs, sizeof gs, "%u", (unsigned)gid);
	snprintf(ps, sizeof ps, "%d", (int)getpid());
	snprintf(os, sizeof os, "%d:%lu:%llu", G.ll_abi, G.nofile, G.fsize);
	av[0] = "dsec-supervisor";
	av[1] = "--supervise";
	av[2] = us;
	av[3] = gs;
	av[4] = (char *)cwd;
	av[5] = ps;
	av[6] = os;
	for (size_t i = 0; i < nc; i++)
		av[7 + i] = cargv[i];

	/* S gets: 0 = C's stdin, 1/2 = output pipes, 3 = control socket, 4 = the Landlock
	 * ruleset (if used); all else is CLOEXEC. The sources are never 0..3 themselves (0..2 are
	 * always open in the agent), and 4 is written last. */
	int ll = -1;
	if (G.ll_abi && (ll = ll_ruleset(G.ll_abi)) < 0) { /* fail closed */
		*err = errno ? errno : EIO;
		goto fail;
	}
	posix_spawn_file_actions_t fa;
	posix_spawnattr_t at;
	sigset_t none, all;
	sigemptyset(&none);
	sigfillset(&all);
	posix_spawn_file_actions_init(&fa);
	if (want_in)
		posix_spawn_file_actions_adddup2(&fa, in[0], 0);
	else
		posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
	posix_spawn_file_actions_adddup2(&fa, o[1], 1);
	posix_spawn_file_actions_adddup2(&fa, e[1], 2);
	posix_spawn_file_actions_adddup2(&fa, sp[1], 3);
	if (ll >= 0)
		posix_spawn_file_actions_adddup2(&fa, ll, 4);
	posix_spawnattr_init(&at);
	posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
	posix_spawnattr_setsigmask(&at, &none);
	posix_spawnattr_setsigdefault(&at, &all);
	pid_t spid;
	int rc = posix_spawn(&spid, G.self, &fa, &at, av, envp);
	if (rc && G.self_alt)
		rc = posix_spawn(&spid, G.self_alt, &fa, &at, av, envp);
	posix_spawn_file_actions_destroy(&fa);
	posix_spawnattr_destroy(&at);
	free(av);
	av = NULL;
	if (rc) {
		*err = rc;
		goto fail;
	}
	close(o[1]);
	close(e[1]);
	close(sp[1]);
	if (want_in)
		close(in[0]);
	p->kind = kind;
	p->owner = owner;
	p->out[0] = o[0];
	p->out[1] = e[0];
	p->in = want_in ? in[1] : -1;
	p->ctl = sp[0];
	set_nonblock(p->out[0]);
	set_nonblock(p->out[1]);
	set_nonblock(p->ctl);
	if (p->in >= 0)
		set_nonblock(p->in);
	p->next = G.procs;
	G.procs = p;
	return p;
fail:
	free(av);
	for (int i = 0; i < 2; i++) {
		xclose(&o[i]);
		xclose(&e[i]);
		xclose(&in[i]);
		xclose(&sp[i]);
	}
	free(p);
	return NULL;
}

/* Ask S to kill C's whole tree; if S is gone, kill C's process group directly. */
static void proc_kill(struct proc *p)
{
	if (p->zombie || p->kill_sent)
		return;
	p->kill_sent = 1;
	p->kill_deadline = now_ms() + KILL_GRACE_MS;
	if (p->ctl >= 0 && send(p->ctl, "K", 1, MSG_DONTWAIT | MSG_NOSIGNAL) == 1)
		return;
	if (p->cpid > 0 && !p->have_status)
		kill(-p->cpid, SIGKILL);
}

static void proc_in_flush(struct proc *p)
{
	while (p->in >= 0 && p->inq.len) {
		ssize_t n = write(p->in, p->inq.p + p->inq.off, p->inq.len);
		if (n > 0) {
			bq_consume(&p->inq, (size_t)n);
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		xclose(&p->in); /* EPIPE: the command closed its stdin */
	}
	if (p->in < 0 || p->in_close)
		bq_free(&p->inq);
	else
		bq_trim(&p->inq);
	if (p->in >= 0 && p->in_close && !p->inq.len)
		xclose(&p->in);
}

static void sess_feed(struct session *s, int st, const char *d, size_t n);

static void proc_output(struct proc *p, int st, const char *d, size_t n)
{
	if (!p->owner)
		return;
	switch (p->kind) {
	case PK_EXEC:
		exec_output(p->owner, st, d, n);
		break;
	case PK_CHECK: {
		struct exec *e = p->owner;
		rbuf_add(&e->chk[st], d, n, CHECK_KEEP);
		break;
	}
	case PK_SESSION:
		sess_feed(p->owner, st, d, n);
		break;
	}
}

/* Read from one output pipe; max_reads bounds the work per call. */
static void proc_read(struct proc *p, int st, int max_reads)
{
	while (p->out[st] >= 0 && max_reads-- > 0) {
		ssize_t n = read(p->out[st], scratch, sizeof scratch);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		if (n <= 0) {
			xclose(&p->out[st]);
			return;
		}
		proc_output(p, st, scratch, (size_t)n);
		if ((size_t)n < sizeof scratch)
			return;
	}
}

static void proc_ctl(struct proc *p)
{
	struct smsg m;
	ssize_t n = recv(p->ctl, &m, sizeof m, MSG_DONTWAIT);
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	if (n <= 0) { /* S is gone */
		xclose(&p->ctl);
		if (!p->have_status) { /* S died without reporting (killed?): treat C as killed */
			if (p->cpid <= 0 && !p->start_err) {
				p->start_err = EIO;
				p->start_stage = ST_SUPERVISOR;
			}
			if (p->cpid > 0)
				kill(-p->cpid, SIGKILL);
			p->status = SIGKILL;
			p->have_status = 1;
			p->exited_at = now_ms();
		}
		return;
	}
	if (n != (ssize_t)sizeof m)
		return;
	switch (m.type) {
	case SM_PID:
		if (m.a > 0) {
			p->cpid = m.a;
			if (p->pending_sig)
				kill(-p->cpid, p->pending_sig);
		} else {
			p->start_err = -m.a;
			p->start_stage = ST_FORK;
		}
		break;
	case SM_STARTERR:
		p->start_err = m.a ? m.a : EIO;
		p->start_stage = m.b;
		break;
	case SM_STATUS:
		if (!p->have_status) {
			p->status = m.a;
			p->have_status = 1;
			p->exited_at = now_ms();
		}
		break;
	}
}

static void exec_plain_done(struct exec *e, struct proc *p);
static void check_done(struct exec *e, struct proc *p);
static void session_shell_done(struct session *s, struct proc *p);

/* The command is over: release the fds (S keeps babysitting background children on its own). */
static void proc_done(struct proc *p)
{
	p->zombie = 1;
	xclose(&p->ctl);
	xclose(&p->in);
	xclose(&p->out[0]);
	xclose(&p->out[1]);
	bq_free(&p->inq);
	void *owner = p->owner;
	p->owner = NULL;
	if (!owner)
		return;
	switch (p->kind) {
	case PK_EXEC:
		exec_plain_done(owner, p);
		break;
	case PK_CHECK:
		check_done(owner, p);
		break;
	case PK_SESSION:
		session_shell_done(owner, p);
		break;
	}
}

/*
 * Finished when C exited and both pipes hit EOF, or LINGER_MS after C exited if
 * background children still hold the pipes (what they write later is lost).
 */
static void proc_tick(struct proc *p, int64_t now)
{
	if (p->zombie)
		return;
	if (!p->have_status) {
		if (!p->kill_deadline || now < p->kill_deadline)
			return;
		p->status = SIGKILL; /* kill requested but nothing reported: give up waiting */
		p->have_status = 1;
		p->exited_at = now - LINGER_MS;
	}
	if ((p->out[0] >= 0 || p->out[1] >= 0) && now < p->exited_at + LINGER_MS)
		return;
	for (int st = 0; st < 2; st++) /* what C wrote before exiting may still sit in the pipe */
		proc_read(p, st, 16);
	proc_done(p);
}

/* ------------------------------------------------------------------ sessions */

static struct session *session_find(const char *name)
{
	for (struct session *s = G.sessions; s; s = s->next)
		if (!s->closing && !strcmp(s->name, name))
			return s;
	return NULL;
}

static void session_free(struct session *s)
{
	for (struct session **pp = &G.sessions; *pp; pp = &(*pp)->next)
		if (*pp == s) {
			*pp = s->next;
			break;
		}
	if (s->shell) { /* not expected: orphan the process, S still reaps it */
		s->shell->owner = NULL;
		proc_kill(s->shell);
	}
	G.nsessions--;
	free(s->name);
	free(s);
}

static void sess_emit(struct session *s, int st, const char *d, size_t n)
{
	if (n && s->cur && s->cur->phase == PH_RUN)
		exec_output(s->cur, st, d, n);
}

static void sess_maybe_done(struct session *s)
{
	struct exec *e = s->cur;
	if (!e || !s->seen[0] || !s->seen[1])
		return;
	e->exit_code = s->code;
	e->sig = 0;
	s->cur = NULL;
	exec_done(e);
}

/*
 * Session output: forward it to the current exec, strip the end markers
 * ("\036DSEC<nonce>:<code>\n" on stdout, "\036DSEC<nonce>:\n" on stderr), and hold back a
 * tail that could be the start of a marker split across reads. Output between commands
 * (background jobs) is read and dropped.
 */
static void sess_feed(struct session *s, int st, const char *d, size_t n)
{
	struct exec *e = s->cur;
	if (!e || e->phase != PH_RUN || s->seen[st]) {
		s->hlen[st] = 0;
		return;
	}
	size_t len = s->hlen[st];
	memcpy(combine, s->hold[st], len);
	memcpy(combine + len, d, n);
	len += n;
	s->hlen[st] = 0;
	const char *M = s->marker;
	size_t ml = s->mlen, scan = 0;
	for (;;) {
		char *m = memmem(combine + scan, len - scan, M, ml);
		if (!m)
			break;
		size_t at = (size_t)(m - combine), k = at + ml;
		int ok = 0, more = 0, code = 0;
		if (st == 0) {
			while (k < len && k - (at + ml) < 4 && combine[k] >= '0' && combine[k] <= '9')
				code = code * 10 + (combine[k++] - '0');
			if (k == len && k - (at + ml) < 4)
				more = 1;
			else if (k < len && combine[k] == '\n' && k > at + ml)
				ok = 1;
		} else {
			if (k == len)
				more = 1;
			else if (combine[k] == '\n')
				ok = 1;
		}
		if (more) {
			sess_emit(s, st, combine, at);
			memcpy(s->hold[st], combine + at, len - at);
			s->hlen[st] = len - at;
			return;
		}
		if (ok) { /* the rest of this read is background noise after the command */
			sess_emit(s, st, combine, at);
			s->seen[st] = 1;
			if (st == 0)
				s->code = code;
			sess_maybe_done(s);
			return;
		}
		scan = at + 1; /* looked like a marker but is not one: plain data */
	}
	for (size_t p = len >= ml ? len - ml + 1 : 0; p < len; p++)
		if (combine[p] == M[0] && !memcmp(combine + p, M, len - p)) {
			sess_emit(s, st, combine, p);
			memcpy(s->hold[st], combine + p, len - p);
			s->hlen[st] = len - p;
			return;
		}
	sess_emit(s, st, combine, len);
}

static void session_shell_done(struct session *s, struct proc *p)
{
	s->shell = NULL;
	struct exec *e = s->cur;
	if (e && e->phase == PH_RUN) {
		for (int st = 0; st < 2; st++) { /* a held-back tail was not a marker after all */
			sess_emit(s, st, s->hold[st], s->hlen[st]);
			s->hlen[st] = 0;
		}
		if (p->start_err) {
			e->failed_err = p->start_err;
			e->failed_stage = p->start_stage;
		}
		set_exit(e, p->status);
		e->session_ended = 1;
		s->cur = NULL;
		exec_done(e);
	}
	if (!s->cur)
		session_free(s);
}

static void check_fail(struct exec *e)
{
	struct session *s = e->sess;
	s->cur = NULL;
	exec_done(e);
	if (!s->shell && !s->cur)
		session_free(s);
}

/* The syntax check finished: report the error, or hand the script to the session shell. */
static void check_done(struct exec *e, struct proc *p)
{
	struct session *s = e->sess;
	e->proc = NULL;
	if (p->start_err) {
		e->failed_err = p->start_err;
		e->failed_stage = p->start_stage;
		check_fail(e);
		return;
	}
	if (e->timed_out) {
		check_fail(e);
		return;
	}
	if (s->closing) {
		e->exit_code = -1;
		e->sig = SIGKILL;
		e->session_ended = 1;
		check_fail(e);
		return;
	}
	if (!WIFEXITED(p->status) || WEXITSTATUS(p->status) != 0) {
		for (int st = 0; st < 2; st++)
			exec_output(e, st, e->chk[st].p, e->chk[st].len);
		set_exit(e, p->status);
		check_fail(e);
		return;
	}
	if (!s->shell) {
		char *av[] = { s->shell_path, NULL };
		int err = 0;
		s->shell = proc_spawn(PK_SESSION, s, e->uid, e->gid, e->cwd ? e->cwd : G.workdir, av, e->env, 1, &err);
		if (!s->shell) {
			e->failed_err = err;
			e->failed_stage = ST_SUPERVISOR;
			check_fail(e);
			return;
		}
	}
	struct proc *sh = s->shell;
	if (sh->in < 0 || bq_append(&sh->inq, e->script, e->script_len) < 0) {
		/* stdin already gone: the shell is exiting; kill it so the exec ends promptly */
		proc_kill(sh);
	}
	free(e->script);
	e->script = NULL;
	memcpy(s->marker, e->marker, sizeof s->marker);
	s->mlen = strlen(s->marker);
	s->seen[0] = s->seen[1] = 0;
	s->hlen[0] = s->hlen[1] = 0;
	e->phase = PH_RUN;
	proc_in_flush(sh);
}

static void exec_plain_done(struct exec *e, struct proc *p)
{
	e->proc = NULL;
	if (p->start_err) {
		e->failed_err = p->start_err;
		e->failed_stage = p->start_stage;
	}
	set_exit(e, p->status);
	exec_done(e);
}

static void exec_timeout(struct exec *e)
{
	e->timed_out = 1;
	if (e->phase == PH_CHECK || !e->sess) {
		if (e->proc)
			proc_kill(e->proc);
	} else if (e->sess->shell) {
		proc_kill(e->sess->shell); /* a session timeout ends the session */
	}
}

/* ------------------------------------------------------------------ request fields */

struct fields {
	const uint8_t *v[F_MAX];
	uint32_t n[F_MAX];
	unsigned char has[F_MAX];
	const uint8_t *raw;
	uint32_t rawlen;
};

static int fields_parse(const uint8_t *p, uint32_t len, struct fields *f)
{
	memset(f, 0, sizeof *f);
	f->raw = p;
	f->rawlen = len;
	uint32_t i = 0;
	while (i < len) {
		if (len - i < 5)
			return -1;
		uint8_t tag = p[i];
		uint32_t l = get32(p + i + 1);
		i += 5;
		if (l > len - i)
			return -1;
		if (tag < F_MAX) {
			f->v[tag] = p + i;
			f->n[tag] = l;
			f->has[tag] = 1;
		}
		i += l;
	}
	return 0;
}

static int f_u32(const struct fields *f, int tag, uint32_t dflt, uint32_t *out)
{
	if (!f->has[tag]) {
		*out = dflt;
		return 0;
	}
	if (f->n[tag] != 4)
		return -1;
	*out = get32(f->v[tag]);
	return 0;
}

/* NUL-terminated copy of a string field; NULL (errno EINVAL/ENOMEM) if it contains a NUL. */
static char *dup_str(const uint8_t *v, uint32_t n)
{
	if (memchr(v, 0, n)) {
		errno = EINVAL;
		return NULL;
	}
	char *s = malloc((size_t)n + 1);
	if (!s) {
		errno = ENOMEM;
		return NULL;
	}
	memcpy(s, v, n);
	s[n] = 0;
	return s;
}

/* Default environment, then ENV fields replacing key by key. One allocation. */
static char **build_env(const struct fields *f, uid_t uid, int *err, const char **why)
{
	char home[PATH_MAX + 8], user[32], logname[32];
	snprintf(home, sizeof home, "HOME=%s", uid == 0 ? "/root" : G.workdir);
	snprintf(user, sizeof user, "USER=%s", uid == 0 ? "root" : "sandbox");
	snprintf(logname, sizeof logname, "LOGNAME=%s", uid == 0 ? "root" : "sandbox");
	const char *defs[] = { "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
			       home, user, logname, "LANG=C.UTF-8", "TERM=dumb" };
	size_t ndef = sizeof defs / sizeof *defs, nenv = 0;
	for (uint32_t i = 0; i < f->rawlen; i += 5 + get32(f->raw + i + 1))
		if (f->raw[i] == F_ENV)
			nenv++;
	if (nenv > MAX_ENV) {
		*err = E2BIG;
		*why = "too many ENV fields";
		return NULL;
	}
	const char **ptr = calloc(ndef + nenv + 1, sizeof *ptr);
	size_t *len = calloc(ndef + nenv + 1, sizeof *len);
	char **out = NULL;
	if (!ptr || !len) {
		*err = ENOMEM;
		*why = "out of memory";
		goto done;
	}
	size_t n = 0;
	for (size_t i = 0; i < ndef; i++) {
		ptr[n] = defs[i];
		len[n++] = strlen(defs[i]);
	}
	for (uint32_t i = 0; i < f->rawlen; i += 5 + get32(f->raw + i + 1)) {
		if (f->raw[i] != F_ENV)
			continue;
		const char *v = (const char *)f->raw + i + 5;
		uint32_t l = get32(f->raw + i + 1);
		const char *eq = memchr(v, '=', l);
		if (!eq || eq == v || memchr(v, 0, l)) {
			*err = EINVAL;
			*why = "ENV must be KEY=VALUE without NUL bytes";
			goto done;
		}
		size_t kl = (size_t)(eq - v) + 1, j;
		for (j = 0; j < n; j++)
			if (len[j] >= kl && !memcmp(ptr[j], v, kl))
				break;
		ptr[j] = v;
		len[j] = l;
		if (j == n)
			n++;
	}
	size_t total = (n + 1) * sizeof(char *);
	for (size_t i = 0; i < n; i++)
		total += len[i] + 1;
	out = malloc(total);
	if (!out) {
		*err = ENOMEM;
		*why = "out of memory";
		goto done;
	}
	char *s = (char *)(out + n + 1);
	for (size_t i = 0; i < n; i++) {
		out[i] = s;
		memcpy(s, ptr[i], len[i]);
		s[len[i]] = 0;
		s += len[i] + 1;
	}
	out[n] = NULL;
done:
	free(ptr);
	free(len);
	return out;
}

static const char *pick_shell(void)
{
	if (G.shell)
		return G.shell;
	return access("/bin/bash", X_OK) == 0 ? "/bin/bash" : "/bin/sh";
}

/* ------------------------------------------------------------------ EXEC and friends */

static void h_exec(uint32_t chan, const struct fields *f)
{
	uint32_t uid, gid, timeout, cap, keep_in, window;
	char *cmd = NULL, *cwd = NULL, *name = NULL, **env = NULL;
	struct exec *e = NULL;
	const char *why = "";
	int err = 0;

	if (!chan) {
		send_err(chan, EINVAL, "EXEC needs a non-zero chan");
		return;
	}
	struct exec *old = exec_find(chan);
	if (old && old->phase != PH_DONE) {
		send_err(chan, EEXIST, "chan %u is running", chan);
		return;
	}
	if (f_u32(f, F_UID, G.uid, &uid) || f_u32(f, F_GID, G.gid, &gid) || f_u32(f, F_TIMEOUT_MS, 0, &timeout) ||
	    f_u32(f, F_CAP, DEFAULT_CAP, &cap) || f_u32(f, F_KEEP_STDIN, 0, &keep_in) || f_u32(f, F_WINDOW, 0, &window)) {
		send_err(chan, EINVAL, "integer fields must be 4 bytes");
		return;
	}
	if (!f->has[F_CMD]) {
		send_err(chan, EINVAL, "EXEC without CMD");
		return;
	}
	if (G.running >= MAX_RUNNING) {
		send_err(chan, EAGAIN, "too many running commands (%d)", MAX_RUNNING);
		return;
	}
	if (!(cmd = dup_str(f->v[F_CMD], f->n[F_CMD]))) {
		send_err(chan, errno, "bad CMD");
		goto out;
	}
	if (f->has[F_CWD]) {
		if (!(cwd = dup_str(f->v[F_CWD], f->n[F_CWD])) || cwd[0] != '/') {
			send_err(chan, EINVAL, "CWD must be an absolute path");
			goto out;
		}
	}
	if (f->has[F_SESSION]) {
		if (!f->n[F_SESSION] || f->n[F_SESSION] > MAX_NAME || !(name = dup_str(f->v[F_SESSION], f->n[F_SESSION]))) {
			send_err(chan, EINVAL, "bad SESSION name");
			goto out;
		}
		if (f->has[F_STDIN] || keep_in) {
			send_err(chan, EINVAL, "STDIN is not supported with SESSION");
			goto out;
		}
	}
	if (!(env = build_env(f, uid, &err, &why))) {
		send_err(chan, err, "%s", why);
		goto out;
	}
	if (old)
		exec_free(old); /* a finished exec on a reused chan is replaced */
	if (!(e = calloc(1, sizeof *e))) {
		send_err(chan, ENOMEM, "out of memory");
		goto out;
	}
	e->chan = chan;
	e->cap = cap > MAX_CAP ? MAX_CAP : cap;
	e->gen = G.gen;
	e->credit = window ? (int64_t)window : -1;
	e->uid = uid;
	e->gid = gid;
	e->deadline = timeout ? now_ms() + timeout : 0;
	e->cwd = cwd;
	cwd = NULL;

	if (!name) {
		char *av[] = { (char *)pick_shell(), "-c", cmd, NULL };
		int want_in = f->has[F_STDIN] || keep_in;
		struct proc *p = proc_spawn(PK_EXEC, e, uid, gid, e->cwd ? e->cwd : G.workdir, av, env, want_in, &err);
		if (!p) {
			send_err(chan, err, "spawn: %s", strerror(err));
			goto out;
		}
		if (f->has[F_STDIN] && f->n[F_STDIN])
			bq_append(&p->inq, f->v[F_STDIN], f->n[F_STDIN]);
		if (!keep_in)
			p->in_close = 1;
		if (want_in)
			proc_in_flush(p);
		e->proc = p;
		e->phase = PH_RUN;
	} else {
		struct session *s = session_find(name);
		if (s && s->cur) {
			send_err(chan, EBUSY, "session %s is busy", name);
			goto out;
		}
		int fresh = !s;
		if (fresh) {
			if (G.nsessions >= MAX_SESSIONS) {
				send_err(chan, EAGAIN, "too many sessions (%d)", MAX_SESSIONS);
				goto out;
			}
			if (!(s = calloc(1, sizeof *s))) {
				send_err(chan, ENOMEM, "out of memory");
				goto out;
			}
			s->name = name;
			name = NULL;
			snprintf(s->shell_path, sizeof s->shell_path, "%s", pick_shell());
			s->next = G.sessions;
			G.sessions = s;
			G.nsessions++;
		}
		/* CMD reaches the shell single-quoted in a variable that is then eval'ed, so nothing
		 * in it (an unterminated here-doc, a trailing backslash, a stray quote) can swallow
		 * the end markers. (bash 5.2 mis-reads the next input line after eval of a *literal*
		 * ending in a backslash; eval of a variable is fine in bash, dash and busybox.)
		 * The syntax check below protects dash/busybox, which exit on a syntax error in eval. */
		char nonce[17];
		random_hex(nonce, 8);
		snprintf(e->marker, sizeof e->marker, "\036DSEC%s:", nonce);
		size_t cl = strlen(cmd), quotes = 0;
		for (size_t i = 0; i < cl; i++)
			quotes += cmd[i] == '\'';
		static const char head[] = "__dsec_c='";
		static const char tail[] = "'; { eval \"$__dsec_c\"; } </dev/null; printf '\\036DSEC%s:%%d\\n' \"$?\"; "
					   "unset __dsec_c; printf '\\036DSEC%s:\\n' >&2\n";
		size_t sl = sizeof head + cl + 3 * quotes + sizeof tail + 2 * sizeof nonce;
		if (!(e->script = malloc(sl))) {
			send_err(chan, ENOMEM, "out of memory");
			if (fresh)
				session_free(s);
			goto out;
		}
		char *w = e->script;
		memcpy(w, head, sizeof head - 1);
		w += sizeof head - 1;
		for (size_t i = 0; i < cl; i++) {
			if (cmd[i] == '\'') {
				memcpy(w, "'\\''", 4);
				w += 4;
			} else {
				*w++ = cmd[i];
			}
		}
		w += snprintf(w, sl - (size_t)(w - e->script), tail, nonce, nonce);
		e->script_len = (size_t)(w - e->script);
		char *av[] = { s->shell_path, "-n", NULL };
		struct proc *p = proc_spawn(PK_CHECK, e, uid, gid, "/", av, env, 1, &err);
		if (!p) {
			send_err(chan, err, "spawn: %s", strerror(err));
			if (fresh)
				session_free(s);
			goto out;
		}
		bq_append(&p->inq, cmd, cl); /* `shell -n` parses CMD from its stdin: no argv size limit */
		p->in_close = 1;
		proc_in_flush(p);
		e->proc = p;
		e->phase = PH_CHECK;
		e->sess = s;
		e->env = env; /* kept to start the session shell */
		env = NULL;
		s->cur = e;
	}
	e->next = G.execs;
	G.execs = e;
	G.running++;
	e = NULL;
out:
	if (e)
		exec_free(e);
	free(cmd);
	free(cwd);
	free(name);
	free_strv(env);
}

static void h_stdin(uint32_t chan, const uint8_t *d, uint32_t n)
{
	struct exec *e = exec_find(chan);
	if (!e || e->phase != PH_RUN || e->sess || !e->proc)
		return;
	struct proc *p = e->proc;
	if (p->in < 0 || p->in_close)
		return;
	if (!n) {
		p->in_close = 1;
	} else if (p->inq.len + n > STDIN_QMAX || bq_append(&p->inq, d, n) < 0) {
		send_err(chan, ENOBUFS, "stdin queue full, %u bytes dropped", n);
		return;
	}
	proc_in_flush(p);
}

static struct proc *exec_target(struct exec *e)
{
	if (e->phase == PH_CHECK || !e->sess)
		return e->proc;
	return e->sess->shell;
}

static void h_signal(uint32_t chan, const uint8_t *d, uint32_t n)
{
	struct exec *e = exec_find(chan);
	if (!e) {
		send_err(chan, ENOENT, "no exec on chan %u", chan);
		return;
	}
	if (n != 4 || get32(d) < 1 || get32(d) >= 65) {
		send_err(chan, EINVAL, "SIGNAL needs a u32 signal number");
		return;
	}
	int sig = (int)get32(d);
	struct proc *p = e->phase == PH_DONE ? NULL : exec_target(e);
	if (!p || p->zombie || p->have_status)
		return;
	if (p->cpid <= 0)
		p->pending_sig = sig;
	else if (kill(-p->cpid, sig) < 0 && errno != ESRCH)
		send_err(chan, errno, "kill: %s", strerror(errno));
}

static void h_attach(uint32_t chan, const uint8_t *p, uint32_t n)
{
	struct fields f;
	uint32_t window = 0;
	if (n && (fields_parse(p, n, &f) < 0 || f_u32(&f, F_WINDOW, 0, &window))) {
		send_err(chan, EINVAL, "malformed fields");
		return;
	}
	struct exec *e = exec_find(chan);
	if (!e) {
		send_err(chan, ENOENT, "no exec on chan %u", chan);
		return;
	}
	e->gen = G.gen;
	e->sent[0] = e->sent[1] = 0;
	e->exit_sent = 0;
	e->credit = window ? (int64_t)window : -1;
}

/* CREDIT: the edge took `n` more bytes of this exec's output off its queue (0xffffffff: it
 * follows the chan no more, send the rest unpaced). One slow reader then holds at most its
 * window in the edge, and the output it has not taken stays here, within CAP. */
static void h_credit(uint32_t chan, const uint8_t *d, uint32_t n)
{
	struct exec *e = exec_find(chan);
	if (!e || n != 4 || e->credit < 0)
		return;
	uint32_t more = get32(d);
	if (more == 0xffffffffu)
		e->credit = -1;
	else if ((e->credit += more) > (int64_t)MAX_PAYLOAD)
		e->credit = MAX_PAYLOAD;
}

static void h_release(uint32_t chan)
{
	struct exec *e = exec_find(chan);
	if (!e)
		return;
	if (e->phase == PH_DONE)
		exec_free(e);
	else
		e->auto_release = 1; /* forget it as soon as its EXIT went out */
}

static void h_session_close(uint32_t chan, const struct fields *f)
{
	char *name = f->has[F_SESSION] ? dup_str(f->v[F_SESSION], f->n[F_SESSION]) : NULL;
	if (!name) {
		send_err(chan, EINVAL, "SESSION_CLOSE needs SESSION");
		return;
	}
	struct session *s = session_find(name);
	free(name);
	if (s) {
		s->closing = 1;
		if (s->shell)
			proc_kill(s->shell);
		if (s->cur && s->cur->phase == PH_CHECK) {
			s->cur->session_ended = 1;
			proc_kill(s->cur->proc);
		}
		if (!s->shell && !s->cur)
			session_free(s);
	}
	send_ok(chan);
}

static void h_list_execs(uint32_t chan)
{
	struct bq b = { 0 };
	for (struct exec *e = G.execs; e; e = e->next) {
		uint8_t r[5];
		put32(r, e->chan);
		r[4] = e->phase == PH_DONE;
		if (bq_append(&b, r, 5) < 0)
			break;
	}
	out_frame(T_EXECS, chan, b.p, b.len, NULL, 0);
	bq_free(&b);
}

static void h_ping(uint32_t chan)
{
	uint8_t b[12];
	put32(b, (uint32_t)getpid());
	put32(b + 4, PROTO_VERSION);
	put32(b + 8, (uint32_t)G.ll_abi); /* Landlock ABI applied to commands, 0: none */
	out_frame(T_PONG, chan, b, sizeof b, NULL, 0);
}

/* ------------------------------------------------------------------ file operations */

/* Filesystem ids of the sandbox user for the duration of one call. */
static void fs_as(uid_t u, gid_t g)
{
	setfsgid(g);
	setfsuid(u);
}
static void fs_restore(void)
{
	setfsuid(geteuid());
	setfsgid(getegid());
}

/*
 * open(2) for the file API without magic links: the agent is unconfined and PID 1, so
 * /proc/1/fd/1 or /proc/self/fd/2 would be *its* stdout/stderr, the host's init.log (and fd 3
 * its socket). openat2(RESOLVE_NO_MAGICLINKS) refuses to traverse any /proc/PID/fd/N, root,
 * cwd, exe or map_files link (ELOOP); ordinary symlinks still resolve, inside the sandbox.
 * Linux < 5.6 has no openat2: plain open (documented limitation).
 */
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
struct open_how_ { uint64_t flags, mode, resolve; };
#define RESOLVE_NO_MAGICLINKS_ 0x02

static int open_nomagic(const char *path, int flags, mode_t mode)
{
	struct open_how_ how = { (uint64_t)flags, (flags & O_CREAT) ? (uint64_t)mode : 0, RESOLVE_NO_MAGICLINKS_ };
	int fd = (int)syscall(SYS_openat2, AT_FDCWD, path, &how, sizeof how);
	if (fd < 0 && errno == ENOSYS)
		fd = open(path, flags, mode);
	return fd;
}

/* openat(2) of one component below `dfd`, without magic links (see open_nomagic). */
static int openat_nomagic(int dfd, const char *name, int flags)
{
	struct open_how_ how = { (uint64_t)flags, 0, RESOLVE_NO_MAGICLINKS_ };
	int fd = (int)syscall(SYS_openat2, dfd, name, &how, sizeof how);
	if (fd < 0 && errno == ENOSYS)
		fd = openat(dfd, name, flags);
	return fd;
}

/*
 * Where the file API writes. It is the agent's own work (unconfined), but it creates, replaces
 * and removes entries only where commands may (Landlock: LL_DENY_TOP and LL_RULES): nothing in
 * /proc, /sys, /dev (except below /dev/shm and /dev/mqueue) or /.dsec, and no file, symlink
 * replacement or removal directly in / -- with one exception: a new top-level *directory*
 * (MKDIR, MKDIRS), the way new writable trees appear for later commands (FnCall's /fncall).
 * Checked on the directory fd the operation then uses (*at calls: nothing is resolved twice),
 * by walking up its `..` chain to the root, with the agent's own ids (only stat and O_PATH).
 */
static const char *const FS_OK_BELOW[] = { "/dev/shm", "/dev/mqueue" };

static int same_inode(const struct stat *a, const struct stat *b)
{
	return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

/* 0 if the file API may add or remove entries in directory `dfd` (`top_ok`: also when it is
 * /, for a new directory); else EPERM with the reason in `why`. */
static int fs_check(int dfd, int top_ok, char *why, size_t wn)
{
	enum { ND = sizeof LL_DENY_TOP / sizeof *LL_DENY_TOP, NO = sizeof FS_OK_BELOW / sizeof *FS_OK_BELOW };
	struct stat root, st, deny[ND], okb[NO];
	int has_deny[ND], has_ok[NO], err = 0;
	uid_t fu = (uid_t)setfsuid((uid_t)-1);
	gid_t fg = (gid_t)setfsgid((gid_t)-1);
	fs_restore();
	if (stat("/", &root) < 0) {
		err = errno;
		goto out;
	}
	for (size_t i = 0; i < ND; i++) {
		char p[32];
		snprintf(p, sizeof p, "/%s", LL_DENY_TOP[i]);
		has_deny[i] = lstat(p, &deny[i]) == 0 && S_ISDIR(deny[i].st_mode);
	}
	for (size_t i = 0; i < NO; i++)
		has_ok[i] = lstat(FS_OK_BELOW[i], &okb[i]) == 0 && S_ISDIR(okb[i].st_mode);
	int cur = openat(dfd, ".", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (cur < 0) {
		err = errno;
		goto out;
	}
	for (int depth = 0; !err; depth++) {
		if (depth >= PATH_MAX || fstat(cur, &st) < 0) {
			err = depth >= PATH_MAX ? ELOOP : errno;
			break;
		}
		if (same_inode(&st, &root)) {
			if (!depth && !top_ok) {
				err = EPERM;
				snprintf(why, wn, "nothing but directories is created or removed directly in / "
					 "(commands may not either); use a directory such as the workdir");
			}
			break;
		}
		int ok = 0;
		for (size_t i = 0; i < NO; i++)
			ok |= has_ok[i] && same_inode(&st, &okb[i]);
		if (ok)
			break;
		for (size_t i = 0; i < ND && !err; i++)
			if (has_deny[i] && same_inode(&st, &deny[i])) {
				err = EPERM;
				snprintf(why, wn, "/%s is off limits to the file API, as to commands%s", LL_DENY_TOP[i],
					 strcmp(LL_DENY_TOP[i], "dev") ? "" : " (only /dev/shm and /dev/mqueue are writable)");
			}
		int up = err ? cur : openat(cur, "..", O_PATH | O_DIRECTORY | O_CLOEXEC);
		if (up < 0) {
			err = errno;
			break;
		}
		if (up != cur) {
			close(cur);
			cur = up;
		}
	}
	close(cur);
out:
	fs_as(fu, fg);
	return err;
}

/*
 * The directory `dir` (absolute) as an O_PATH fd for the file API's writes, as the current fs
 * ids. With `create`, missing components are made (0755, the last one `last_mode` exactly),
 * each only where fs_check allows. Returns the fd, or -1 with the errno in *err (EPERM: the
 * reason is in `why`); *created_last (if given) tells whether the last component was made.
 */
static int fs_dir(const char *dir, int create, mode_t last_mode, int *created_last, int *err, char *why, size_t wn)
{
	char comp[NAME_MAX + 1];
	*err = 0;
	if (created_last)
		*created_last = 0;
	int dfd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
	const char *p = dir;
	while (dfd >= 0 && *p) {
		while (*p == '/')
			p++;
		size_t n = strcspn(p, "/");
		if (!n)
			break;
		if (n > NAME_MAX) {
			close(dfd);
			*err = ENAMETOOLONG;
			return -1;
		}
		memcpy(comp, p, n);
		comp[n] = 0;
		p += n;
		int last = !p[strspn(p, "/")];
		int next = openat_nomagic(dfd, comp, O_PATH | O_DIRECTORY | O_CLOEXEC);
		if (next < 0 && errno == ENOENT && create) {
			int e = fs_check(dfd, 1, why, wn);
			if (e) {
				close(dfd);
				*err = e;
				return -1;
			}
			int made = mkdirat(dfd, comp, last ? 0700 : 0755) == 0;
			if (!made && errno != EEXIST) {
				*err = errno;
				close(dfd);
				return -1;
			}
			if (made && last) { /* exact mode, whatever the umask; through an fd, not the name */
				next = openat(dfd, comp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
				if (next >= 0 && fchmod(next, last_mode & 07777) < 0) {
					*err = errno;
					close(next);
					close(dfd);
					return -1;
				}
				if (next >= 0 && created_last)
					*created_last = 1;
			} else {
				next = openat_nomagic(dfd, comp, O_PATH | O_DIRECTORY | O_CLOEXEC);
			}
		}
		if (next < 0)
			*err = errno;
		close(dfd);
		dfd = next;
	}
	if (dfd < 0 && !*err)
		*err = errno;
	return dfd;
}

/* PATH field -> absolute path (relative to WORKDIR). Returns 0 or an errno. */
static int get_path(const struct fields *f, char *out)
{
	if (!f->has[F_PATH] || !f->n[F_PATH] || memchr(f->v[F_PATH], 0, f->n[F_PATH]))
		return EINVAL;
	size_t n = f->n[F_PATH], pre = 0;
	if (f->v[F_PATH][0] != '/') {
		pre = strlen(G.workdir);
		if (pre + 1 + n >= PATH_MAX)
			return ENAMETOOLONG;
		memcpy(out, G.workdir, pre);
		out[pre++] = '/';
	}
	if (pre + n >= PATH_MAX)
		return ENAMETOOLONG;
	memcpy(out + pre, f->v[F_PATH], n);
	out[pre + n] = 0;
	return 0;
}

/* An optional u32 field of a file request: its tag, default and destination. */
struct u32_field { int tag; uint32_t dflt; uint32_t *out; };

/* The prologue every file request shares: PATH (resolved against the workdir), UID, GID and
 * the request's own u32 fields. 0, or -1 once an ERROR has gone out on `chan`. */
static int file_request(uint32_t chan, const struct fields *f, char *path, uint32_t *uid, uint32_t *gid,
			const struct u32_field *more, size_t nmore)
{
	int err = get_path(f, path);
	if (err) {
		send_err(chan, err, "bad PATH");
		return -1;
	}
	int bad = f_u32(f, F_UID, G.uid, uid) || f_u32(f, F_GID, G.gid, gid);
	for (size_t i = 0; i < nmore && !bad; i++)
		bad = f_u32(f, more[i].tag, more[i].dflt, more[i].out);
	if (bad) {
		send_err(chan, EINVAL, "integer fields must be 4 bytes");
		return -1;
	}
	return 0;
}

/* mkdir -p of path[0..upto); returns 0 or an errno. *created_last set if the last was made. */
static int mkdirs(char *path, size_t upto, mode_t mode, int *created_last)
{
	if (created_last)
		*created_last = 0;
	for (size_t i = 1; i <= upto; i++) {
		if (i < upto && path[i] != '/')
			continue;
		if (path[i - 1] == '/') /* empty component */
			continue;
		char c = path[i];
		path[i] = 0;
		int r = mkdir(path, i == upto ? mode : 0755);
		int err = errno;
		if (r == 0 && i == upto && created_last)
			*created_last = 1;
		if (r < 0 && err == EEXIST) {
			struct stat st;
			r = stat(path, &st);
			err = r < 0 ? errno : (S_ISDIR(st.st_mode) ? 0 : ENOTDIR);
			r = err ? -1 : 0;
		}
		path[i] = c;
		if (r < 0)
			return err;
	}
	return 0;
}

static void h_file_read(uint32_t chan, const struct fields *f)
{
	char path[PATH_MAX];
	uint32_t uid, gid, maxlen;
	if (file_request(chan, f, path, &uid, &gid, (struct u32_field[]){ { F_MAXLEN, DEFAULT_MAXLEN, &maxlen } }, 1))
		return;
	int err = 0;
	if (G.nreaders >= MAX_READERS) {
		send_err(chan, EAGAIN, "too many concurrent file reads (%d)", MAX_READERS);
		return;
	}
	fs_as(uid, gid);
	int fd = open_nomagic(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK, 0); /* O_NONBLOCK: a FIFO must not hang us */
	err = errno;
	fs_restore();
	if (fd < 0) {
		send_err(chan, err, "%s: %s", path, strerror(err));
		return;
	}
	struct stat st;
	if (fstat(fd, &st) < 0)
		st.st_mode = 0;
	if (!S_ISREG(st.st_mode)) {
		err = S_ISDIR(st.st_mode) ? EISDIR : EINVAL;
		send_err(chan, err, "%s: %s", path, err == EISDIR ? strerror(err) : "not a regular file");
		close(fd);
		return;
	}
	if ((uint64_t)st.st_size > maxlen) {
		send_err(chan, EFBIG, "%s: %lld bytes > MAXLEN %u", path, (long long)st.st_size, maxlen);
		close(fd);
		return;
	}
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
	struct freader *r = calloc(1, sizeof *r);
	if (!r) {
		send_err(chan, ENOMEM, "out of memory");
		close(fd);
		return;
	}
	r->chan = chan;
	r->fd = fd;
	r->maxlen = maxlen;
	r->gen = G.gen;
	r->next = G.readers;
	G.readers = r;
	G.nreaders++;
}

/* Send the next DATA chunks of a file read; returns 1 when the reader is finished. */
static int reader_pump(struct freader *r)
{
	while (G.conn >= 0 && r->gen == G.gen) { /* connection gone: the read is cancelled */
		if (G.out.len >= OUTQ_PACE)
			return 0; /* more once the edge has read some */
		uint64_t left = r->maxlen - r->sent;
		size_t want = left > FILE_CHUNK ? FILE_CHUNK : (size_t)left;
		if (bq_reserve(&G.out, HDR + (want ? want : 1)) < 0) {
			conn_close();
			break;
		}
		uint8_t *w = (uint8_t *)G.out.p + G.out.off + G.out.len;
		/* at MAXLEN read one more byte: the file must really end there */
		ssize_t n = read(r->fd, w + HDR, want ? want : 1);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			send_err(r->chan, errno, "read: %s", strerror(errno));
			break;
		}
		if (n == 0) {
			uint8_t t[8];
			put64(t, r->sent);
			out_frame(T_OK, r->chan, t, 8, NULL, 0);
			break;
		}
		if (!want) {
			send_err(r->chan, EFBIG, "file grew beyond MAXLEN %llu", (unsigned long long)r->maxlen);
			break;
		}
		put_hdr(w, (uint32_t)n, T_DATA, r->chan);
		G.out.len += HDR + (size_t)n;
		r->sent += (uint64_t)n;
	}
	close(r->fd);
	return 1;
}

static void h_file_write(uint32_t chan, const struct fields *f)
{
	char path[PATH_MAX], tmp[PATH_MAX];
	uint32_t uid, gid, mode, mk;
	if (file_request(chan, f, path, &uid, &gid,
			 (struct u32_field[]){ { F_MODE, 0644, &mode }, { F_MKDIRS, 0, &mk } }, 2))
		return;
	int err = 0;
	char *slash = strrchr(path, '/');
	const char *base = slash + 1;
	if (!*base || !strcmp(base, ".") || !strcmp(base, "..")) {
		send_err(chan, EISDIR, "%s: is a directory", path);
		return;
	}
	size_t dlen = (size_t)(slash - path);
	char suffix[17], why[200] = "";
	const char *what = mk ? "mkdir" : "open";
	int fd = -1;
	fs_as(uid, gid);
	snprintf(tmp, sizeof tmp, "%.*s", (int)dlen, path);
	int dfd = fs_dir(tmp, (int)mk, 0755, NULL, &err, why, sizeof why);
	if (dfd < 0)
		goto done;
	what = "write";
	if ((err = fs_check(dfd, 0, why, sizeof why)))
		goto done;
	what = "open";
	for (int tries = 0; tries < 5; tries++) {
		random_hex(suffix, 8);
		if (snprintf(tmp, sizeof tmp, ".%s.dsec-%s", base, suffix) > NAME_MAX) {
			err = ENAMETOOLONG;
			goto done;
		}
		fd = openat(dfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
		if (fd >= 0 || errno != EEXIST)
			break;
	}
	if (fd < 0) {
		err = errno;
		goto done;
	}
	const uint8_t *d = f->has[F_DATA] ? f->v[F_DATA] : NULL;
	size_t left = f->has[F_DATA] ? f->n[F_DATA] : 0;
	what = "write";
	while (left) {
		ssize_t n = write(fd, d, left);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			err = n < 0 ? errno : EIO;
			break;
		}
		d += n;
		left -= (size_t)n;
	}
	if (!err && fchmod(fd, mode & 07777) < 0) {
		err = errno;
		what = "chmod";
	}
	if (close(fd) < 0 && !err) {
		err = errno;
		what = "close";
	}
	if (!err && renameat(dfd, tmp, dfd, base) < 0) {
		err = errno;
		what = "rename";
	}
	if (err)
		unlinkat(dfd, tmp, 0);
done:
	if (dfd >= 0)
		close(dfd);
	fs_restore();
	if (err)
		send_err(chan, err, "%s %s: %s", what, path, err == EPERM && *why ? why : strerror(err));
	else
		send_ok(chan);
}

static void h_list(uint32_t chan, const struct fields *f)
{
	char path[PATH_MAX];
	uint32_t uid, gid;
	if (file_request(chan, f, path, &uid, &gid, NULL, 0))
		return;
	int err = 0;
	fs_as(uid, gid);
	int dfd = open_nomagic(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
	DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
	struct bq b = { 0 };
	err = d ? 0 : errno;
	if (!d && dfd >= 0)
		close(dfd);
	struct dirent *de;
	while (d && !err && (errno = 0, de = readdir(d))) {
		const char *nm = de->d_name;
		if (!strcmp(nm, ".") || !strcmp(nm, ".."))
			continue;
		struct stat st;
		uint8_t r[23];
		size_t nl = strlen(nm);
		memset(r, 0, sizeof r);
		if (fstatat(dfd, nm, &st, AT_SYMLINK_NOFOLLOW) == 0) {
			r[0] = S_ISREG(st.st_mode) ? 0 : S_ISDIR(st.st_mode) ? 1 : S_ISLNK(st.st_mode) ? 2 : 3;
			put32(r + 1, st.st_mode & 07777);
			put64(r + 5, (uint64_t)st.st_size);
			put64(r + 13, (uint64_t)((int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec));
		} else { /* unsearchable directory or entry vanished: report what readdir knows */
			r[0] = de->d_type == DT_REG ? 0 : de->d_type == DT_DIR ? 1 : de->d_type == DT_LNK ? 2 : 3;
		}
		put16(r + 21, (uint16_t)nl);
		if (b.len + sizeof r + nl > LISTING_MAX) {
			err = E2BIG;
			break;
		}
		if (bq_append(&b, r, sizeof r) < 0 || bq_append(&b, nm, nl) < 0)
			err = ENOMEM;
	}
	if (d && !err && errno)
		err = errno;
	if (d)
		closedir(d);
	fs_restore();
	if (err)
		send_err(chan, err, "%s: %s", path, err == E2BIG ? "directory listing too large" : strerror(err));
	else
		out_frame(T_LISTING, chan, b.p, b.len, NULL, 0);
	bq_free(&b);
}

static void h_remove(uint32_t chan, const struct fields *f)
{
	char path[PATH_MAX];
	uint32_t uid, gid;
	if (file_request(chan, f, path, &uid, &gid, NULL, 0))
		return;
	int err = 0;
	size_t n = strlen(path);
	while (n > 1 && path[n - 1] == '/')
		path[--n] = 0;
	char *slash = strrchr(path, '/'), why[200] = "";
	const char *base = slash + 1;
	if (!*base || !strcmp(base, ".") || !strcmp(base, "..")) {
		send_err(chan, *base ? EINVAL : EBUSY, "%s: cannot remove", path);
		return;
	}
	*slash = 0; /* the parent, as an fd: the checked directory is the one written */
	fs_as(uid, gid);
	int dfd = fs_dir(path, 0, 0, NULL, &err, why, sizeof why), r = -1;
	*slash = '/';
	if (dfd >= 0 && !(err = fs_check(dfd, 0, why, sizeof why))) {
		r = unlinkat(dfd, base, 0);
		if (r < 0 && (errno == EISDIR || errno == EPERM)) {
			struct stat st;
			if (fstatat(dfd, base, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode))
				r = unlinkat(dfd, base, AT_REMOVEDIR);
			else
				errno = EPERM;
		}
		err = r < 0 ? errno : 0;
	}
	if (dfd >= 0)
		close(dfd);
	fs_restore();
	if (err)
		send_err(chan, err, "%s: %s", path, err == EPERM && *why ? why : strerror(err));
	else
		send_ok(chan);
}

static void h_mkdir(uint32_t chan, const struct fields *f)
{
	char path[PATH_MAX];
	uint32_t uid, gid, mode;
	if (file_request(chan, f, path, &uid, &gid, (struct u32_field[]){ { F_MODE, 0755, &mode } }, 1))
		return;
	int err = 0, created = 0;
	size_t n = strlen(path);
	while (n > 1 && path[n - 1] == '/')
		path[--n] = 0;
	char why[200] = "";
	fs_as(uid, gid);
	int dfd = fs_dir(path, 1, mode, &created, &err, why, sizeof why); /* exact mode, whatever the umask */
	if (dfd >= 0)
		close(dfd);
	fs_restore();
	if (err)
		send_err(chan, err, "%s: %s", path, err == EPERM && *why ? why : strerror(err));
	else
		send_ok(chan);
}

/* ------------------------------------------------------------------ VM guest refresh */

/* <linux/random.h> values, spelled out because musl-gcc does not see the kernel headers. */
#define DSEC_RNDADDENTROPY 0x40085203 /* _IOW('R', 0x03, int[2]) */
#define DSEC_RNDRESEEDCRNG 0x5207     /* _IO('R', 0x07) */
#define REFRESH_SEED_MAX 512

/* A restored VM is a byte copy of another guest: same clock, same CRNG state. Writing to
 * /dev/urandom only mixes into the input pool (the CRNG keeps its key until its next timed
 * reseed), so the seed is credited with RNDADDENTROPY and the CRNG reseeded at once. */
static void h_refresh(uint32_t chan, const struct fields *f)
{
	if (!G.dev) {
		send_err(chan, EPERM, "REFRESH is only for VM guests (agent in device mode)");
		return;
	}
	if ((f->has[F_TIME_NS] && f->n[F_TIME_NS] != 8) ||
	    (f->has[F_DATA] && (f->n[F_DATA] == 0 || f->n[F_DATA] > REFRESH_SEED_MAX))) {
		send_err(chan, EINVAL, "TIME_NS must be 8 bytes, DATA 1..%d bytes", REFRESH_SEED_MAX);
		return;
	}
	if (f->has[F_TIME_NS]) {
		uint64_t ns = get64(f->v[F_TIME_NS]);
		struct timespec ts = { .tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u) };
		if (clock_settime(CLOCK_REALTIME, &ts) < 0) {
			send_err(chan, errno, "clock_settime: %s", strerror(errno));
			return;
		}
	}
	if (f->has[F_DATA]) {
		struct { int entropy_count, buf_size; uint8_t buf[REFRESH_SEED_MAX]; } pool;
		pool.entropy_count = (int)f->n[F_DATA] * 8;
		pool.buf_size = (int)f->n[F_DATA];
		memcpy(pool.buf, f->v[F_DATA], f->n[F_DATA]);
		int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC), err = 0;
		if (fd < 0 || ioctl(fd, DSEC_RNDADDENTROPY, &pool) < 0)
			err = errno;
		else if (ioctl(fd, DSEC_RNDRESEEDCRNG) < 0 && errno != ENODATA) /* ENODATA: not seeded yet */
			err = errno;
		if (fd >= 0)
			close(fd);
		explicit_bzero(pool.buf, sizeof pool.buf);
		if (err) {
			send_err(chan, err, "reseeding the guest RNG: %s", strerror(err));
			return;
		}
	}
	send_ok(chan);
}

/* ------------------------------------------------------------------ directory watches */

/*
 * WATCH streams inotify events of a directory (with RECURSIVE, of its whole tree, up to
 * WATCH_DIRS_MAX directories) as EVENT frames until UNWATCH, a new connection, or the
 * directory's removal (then ERROR ENOENT). Directories are opened as the request's UID/GID,
 * beneath the watched root (no symlinks, no magic links), and only where the file API may
 * work (fs_check): nothing in /proc, /sys, /dev or /.dsec is watched.
 */
#define WATCH_MASK (IN_CREATE | IN_DELETE | IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | \
		    IN_DELETE_SELF | IN_ONLYDIR)
#define RESOLVE_NO_SYMLINKS_ 0x04
#define RESOLVE_BENEATH_ 0x08

/* `rel` (relative, "" for the root itself) below the watch root, without following symlinks. */
static int open_beneath(int root, const char *rel, int flags)
{
	if (!*rel)
		return openat(root, ".", flags);
	struct open_how_ how = { (uint64_t)flags, 0, RESOLVE_BENEATH_ | RESOLVE_NO_SYMLINKS_ | RESOLVE_NO_MAGICLINKS_ };
	int fd = (int)syscall(SYS_openat2, root, rel, &how, sizeof how);
	if (fd < 0 && errno == ENOSYS)
		fd = openat(root, rel, flags | O_NOFOLLOW);
	return fd;
}

/* Index of the first watched directory with wd >= `wd`. */
static size_t wdir_at(const struct watch *w, int wd)
{
	size_t lo = 0, hi = w->ndirs;
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		if (w->dirs[mid].wd < wd)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static void wdir_remove(struct watch *w, size_t i)
{
	free(w->dirs[i].rel);
	memmove(w->dirs + i, w->dirs + i + 1, (w->ndirs - i - 1) * sizeof *w->dirs);
	w->ndirs--;
}

/* Watch the directory `dfd` (as the watch's fs ids, current) under the name `rel`: 0 or an errno. */
static int watch_add(struct watch *w, int dfd, const char *rel)
{
	if (w->ndirs >= WATCH_DIRS_MAX)
		return E2BIG;
	/* the directory itself, not a name that could be swapped: "." after fchdir (no /proc needed) */
	int wd = fchdir(dfd) < 0 ? -1 : inotify_add_watch(w->ifd, ".", WATCH_MASK);
	int err = wd < 0 ? errno : 0;
	uid_t fu = (uid_t)setfsuid((uid_t)-1);
	gid_t fg = (gid_t)setfsgid((gid_t)-1);
	fs_restore();
	if (chdir("/") < 0) { /* the agent's usual cwd; "/" always exists */ }
	fs_as(fu, fg);
	if (err)
		return err;
	size_t i = wdir_at(w, wd);
	char *copy = strdup(rel);
	if (!copy)
		return ENOMEM;
	if (i < w->ndirs && w->dirs[i].wd == wd) { /* the same directory, reached again: its new name */
		free(w->dirs[i].rel);
		w->dirs[i].rel = copy;
		return 0;
	}
	if (w->ndirs == w->cap) {
		size_t nc = w->cap ? w->cap * 2 : 16;
		struct wdir *nd = realloc(w->dirs, nc * sizeof *nd);
		if (!nd) {
			free(copy);
			inotify_rm_watch(w->ifd, wd);
			return ENOMEM;
		}
		w->dirs = nd;
		w->cap = nc;
	}
	memmove(w->dirs + i + 1, w->dirs + i, (w->ndirs - i) * sizeof *w->dirs);
	w->dirs[i] = (struct wdir){ wd, copy };
	w->ndirs++;
	if (!*rel)
		w->root_wd = wd;
	return 0;
}

/* Stop watching `rel` and everything below it (it was moved away or removed). */
static void watch_drop(struct watch *w, const char *rel)
{
	size_t n = strlen(rel);
	for (size_t i = 0; i < w->ndirs;) {
		const char *r = w->dirs[i].rel;
		if (n && !strncmp(r, rel, n) && (!r[n] || r[n] == '/')) {
			inotify_rm_watch(w->ifd, w->dirs[i].wd);
			wdir_remove(w, i);
		} else {
			i++;
		}
	}
}

static int ev_append(struct bq *b, uint32_t mask, const char *name, size_t nl);

/* Watch `rel` and (recursive) the directories below it, breadth first. `strict` (the initial
 * walk): the root must be watchable and the tree must fit WATCH_DIRS_MAX, else an errno; later
 * walks (a directory appeared) watch what they can and, into `found`, report as created what
 * each new directory already holds: entries made before its inotify watch was in place (as in
 * `mkdir -p a/b && touch a/b/f`, or a tree moved in) would otherwise never be reported. Such an
 * entry may be reported twice (by the walk and by inotify); never not at all. */
static int watch_tree(struct watch *w, int root, const char *rel, int strict, struct bq *found)
{
	char **q = NULL, why[160];
	size_t qi = 0, qn = 0, qcap = 0;
	int err = 0, full = 0, lost = 0;
	char *first = strdup(rel);
	if (!first)
		return ENOMEM;
	q = malloc(sizeof *q);
	if (!q) {
		free(first);
		return ENOMEM;
	}
	q[qn++] = first;
	qcap = 1;
	fs_as(w->uid, w->gid);
	while (qi < qn && !err && !full) {
		char *r = q[qi++];
		int fd = open_beneath(root, r, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		int e = fd < 0 ? errno : 0;
		if (!e && *r && fs_check(fd, 1, why, sizeof why))
			e = EPERM;
		if (!e)
			e = watch_add(w, fd, r);
		if (e) {
			if (strict && (!*r || e == E2BIG))
				err = e;
			full = e == E2BIG;  /* watch what fits, no more */
		}
		DIR *d = !e && w->recursive ? fdopendir(fd) : NULL;
		if (!d && fd >= 0)
			close(fd);
		struct dirent *de;
		while (d && !err && (de = readdir(d))) {
			const char *nm = de->d_name;
			if (!strcmp(nm, ".") || !strcmp(nm, ".."))
				continue;
			int isdir = de->d_type == DT_DIR;
			struct stat sb;
			if (de->d_type == DT_UNKNOWN)
				isdir = fstatat(dirfd(d), nm, &sb, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(sb.st_mode);
			size_t rl = strlen(r), nl = strlen(nm);
			if (rl + 1 + nl >= PATH_MAX)
				continue;
			if (found && found->len < WATCH_FOUND_MAX) {
				char fn[PATH_MAX];
				int fl = snprintf(fn, sizeof fn, "%s%s%s", r, rl ? "/" : "", nm);
				if (fl > 0 && fl <= 0xffff)
					ev_append(found, IN_CREATE | (isdir ? IN_ISDIR : 0), fn, (size_t)fl);
			} else if (found && !lost) { /* a huge tree moved in: say events were lost, once */
				ev_append(found, IN_Q_OVERFLOW, "", 0);
				lost = 1;
			}
			if (!isdir)
				continue;
			if (w->ndirs + (qn - qi) >= WATCH_DIRS_MAX) {
				err = strict ? E2BIG : 0;
				full = 1;
				break;
			}
			char *c = malloc(rl + 1 + nl + 1);
			if (!c)
				break;
			if (rl)
				memcpy(c, r, rl), c[rl] = '/', memcpy(c + rl + 1, nm, nl + 1);
			else
				memcpy(c, nm, nl + 1);
			if (qn == qcap) {
				size_t nc = qcap * 2;
				char **nq = realloc(q, nc * sizeof *nq);
				if (!nq) {
					free(c);
					break;
				}
				q = nq;
				qcap = nc;
			}
			q[qn++] = c;
		}
		if (d)
			closedir(d);
	}
	fs_restore();
	for (size_t i = 0; i < qn; i++)
		free(q[i]);
	free(q);
	return err;
}

/* The watched directory, opened as the watch's user; the first time its identity is noted,
 * later it must be the same directory (else -1: it was removed or replaced). */
static int watch_root(struct watch *w, int *err)
{
	fs_as(w->uid, w->gid);
	int fd = open_nomagic(w->path, O_PATH | O_DIRECTORY | O_CLOEXEC, 0);
	*err = fd < 0 ? errno : 0;
	fs_restore();
	struct stat st;
	if (fd >= 0 && fstat(fd, &st) < 0) {
		*err = errno;
	} else if (fd >= 0 && !w->ino) {
		w->dev = st.st_dev;
		w->ino = st.st_ino;
	} else if (fd >= 0 && (st.st_dev != w->dev || st.st_ino != w->ino)) {
		*err = ENOENT;
	}
	if (*err && fd >= 0) {
		close(fd);
		fd = -1;
	}
	return fd;
}

/* A directory appeared at `rel` in a recursive watch: watch it and what it holds, reporting
 * that into `found`. */
static void watch_new_dir(struct watch *w, const char *rel, struct bq *found)
{
	int err, root = watch_root(w, &err);
	if (root >= 0) {
		watch_tree(w, root, rel, 0, found);
		close(root);
	}
}

static void watch_free(struct watch *w)
{
	if (w->ifd >= 0)
		close(w->ifd);      /* removes every inotify watch of it */
	free(w->path);
	for (size_t i = 0; i < w->ndirs; i++)
		free(w->dirs[i].rel);
	free(w->dirs);
	free(w);
}

static struct watch *watch_find(uint32_t chan)
{
	for (struct watch *w = G.watches; w; w = w->next)
		if (w->chan == chan && w->gen == G.gen)
			return w;
	return NULL;
}

/* Free the watches that are over: ended, unwatched (chan 0) or of an older connection. */
static void watch_reap(void)
{
	for (struct watch **pp = &G.watches; *pp;) {
		struct watch *w = *pp;
		if (w->ended || !w->chan || w->gen != G.gen) {
			if (w->ended && w->chan && w->gen == G.gen)
				send_err(w->chan, w->ended, "the watched directory was removed");
			*pp = w->next;
			watch_free(w);
			G.nwatches--;
		} else {
			pp = &w->next;
		}
	}
}

static int ev_append(struct bq *b, uint32_t mask, const char *name, size_t nl)
{
	uint8_t h[6];
	put32(h, mask);
	put16(h + 4, (uint16_t)nl);
	return bq_append(b, h, sizeof h) < 0 || bq_append(b, name, nl) < 0 ? -1 : 0;
}

/* inotify events of `w` -> one EVENT frame: repeated u32 mask, u16 name_len, name (relative
 * to the watched directory). Watches of directories that appear or leave are kept in step. */
static void watch_read(struct watch *w)
{
	static char buf[64 << 10] __attribute__((aligned(__alignof__(struct inotify_event))));
	ssize_t n = read(w->ifd, buf, sizeof buf);
	if (n <= 0)
		return;
	struct bq b = { 0 };
	char name[PATH_MAX];
	for (char *p = buf; p < buf + n;) {
		const struct inotify_event *ev = (const struct inotify_event *)p;
		p += sizeof *ev + ev->len;
		if (ev->mask & IN_Q_OVERFLOW) { /* events were lost: the edge says so */
			ev_append(&b, IN_Q_OVERFLOW, "", 0);
			continue;
		}
		size_t i = wdir_at(w, ev->wd);
		if (i >= w->ndirs || w->dirs[i].wd != ev->wd)
			continue;           /* a watch dropped a moment ago */
		if (ev->mask & IN_IGNORED) {
			if (ev->wd == w->root_wd)
				w->ended = ENOENT;
			wdir_remove(w, i);
			continue;
		}
		if (!ev->len)
			continue;           /* about the directory itself: its parent reported it */
		const char *rel = w->dirs[i].rel;
		int nn = snprintf(name, sizeof name, "%s%s%s", rel, *rel ? "/" : "", ev->name);
		if (nn < 0 || (size_t)nn >= sizeof name || nn > 0xffff)
			continue;
		if (ev_append(&b, ev->mask & (WATCH_MASK | IN_ISDIR), name, (size_t)nn) < 0)
			break;
		if (w->recursive && (ev->mask & IN_ISDIR)) {
			if (ev->mask & (IN_MOVED_FROM | IN_DELETE))
				watch_drop(w, name);
			if (ev->mask & (IN_CREATE | IN_MOVED_TO))
				watch_new_dir(w, name, &b);
		}
	}
	if (b.len)
		out_frame(T_EVENT, w->chan, b.p, b.len, NULL, 0);
	bq_free(&b);
}

static void h_watch(uint32_t chan, const struct fields *f)
{
	char path[PATH_MAX], why[160] = "";
	uint32_t uid, gid, recursive;
	if (file_request(chan, f, path, &uid, &gid, (struct u32_field[]){ { F_RECURSIVE, 0, &recursive } }, 1))
		return;
	int err = 0;
	if (watch_find(chan)) {
		send_err(chan, EBUSY, "chan %u already carries a watch", chan);
		return;
	}
	watch_reap();
	if (G.nwatches >= MAX_WATCHES) {
		send_err(chan, EAGAIN, "too many directory watches (%d); stop one first", MAX_WATCHES);
		return;
	}
	struct watch *w = calloc(1, sizeof *w);
	if (!w) {
		send_err(chan, ENOMEM, "out of memory");
		return;
	}
	*w = (struct watch){ .chan = chan, .gen = G.gen, .ifd = -1, .root_wd = -1,
			     .recursive = recursive != 0, .uid = uid, .gid = gid, .path = strdup(path) };
	w->ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
	if (!w->path) {
		err = ENOMEM;
	} else if (w->ifd < 0) {
		err = errno;
		snprintf(why, sizeof why, "inotify: %s (the host's fs.inotify.max_user_instances?)", strerror(err));
	} else {
		int root = watch_root(w, &err);
		if (!err)
			err = fs_check(root, 1, why, sizeof why);
		if (!err)
			err = watch_tree(w, root, "", 1, NULL);
		if (err == E2BIG)
			snprintf(why, sizeof why, "more than %d directories to watch; watch a smaller tree", WATCH_DIRS_MAX);
		if (root >= 0)
			close(root);
	}
	if (err) {
		send_err(chan, err, "%s: %s", path, why[0] ? why : strerror(err));
		watch_free(w);
		return;
	}
	w->next = G.watches;
	G.watches = w;
	G.nwatches++;
	send_ok(chan);
}

static void h_unwatch(uint32_t chan)
{
	struct watch *w = watch_find(chan);
	if (w)
		w->chan = 0;        /* freed by watch_reap; nothing more goes out on the chan */
}

/* ------------------------------------------------------------------ frame dispatch */

static void handle_frame(int type, uint32_t chan, const uint8_t *p, uint32_t n)
{
	struct fields f;
	switch (type) {
	case T_STDIN:
		h_stdin(chan, p, n);
		return;
	case T_SIGNAL:
		h_signal(chan, p, n);
		return;
	case T_RELEASE:
		h_release(chan);
		return;
	case T_ATTACH:
		h_attach(chan, p, n);
		return;
	case T_CREDIT:
		h_credit(chan, p, n);
		return;
	case T_PING:
		h_ping(chan);
		return;
	case T_LIST_EXECS:
		h_list_execs(chan);
		return;
	case T_UNWATCH:
		h_unwatch(chan);
		return;
	case T_EXEC: case T_FILE_READ: case T_FILE_WRITE: case T_LIST: case T_SESSION_CLOSE:
	case T_REMOVE: case T_MKDIR: case T_REFRESH: case T_WATCH:
		break;
	default:
		send_err(chan, EINVAL, "unknown frame type %d", type);
		return;
	}
	if (fields_parse(p, n, &f) < 0) {
		send_err(chan, EINVAL, "malformed fields");
		return;
	}
	switch (type) {
	case T_EXEC: h_exec(chan, &f); break;
	case T_FILE_READ: h_file_read(chan, &f); break;
	case T_FILE_WRITE: h_file_write(chan, &f); break;
	case T_LIST: h_list(chan, &f); break;
	case T_SESSION_CLOSE: h_session_close(chan, &f); break;
	case T_REMOVE: h_remove(chan, &f); break;
	case T_MKDIR: h_mkdir(chan, &f); break;
	case T_REFRESH: h_refresh(chan, &f); break;
	case T_WATCH: h_watch(chan, &f); break;
	}
}

static void conn_read(void)
{
	int fd = G.conn;
	size_t want = READ_CHUNK;
	if (G.in.len >= HDR) { /* read the rest of a large frame in one go */
		uint32_t l = get32((uint8_t *)G.in.p + G.in.off);
		if (l <= MAX_PAYLOAD && HDR + l > G.in.len && HDR + l - G.in.len > want)
			want = HDR + l - G.in.len;
	}
	if (bq_reserve(&G.in, want) < 0) {
		conn_close();
		return;
	}
	ssize_t n = read(fd, G.in.p + G.in.off + G.in.len, G.in.cap - G.in.off - G.in.len);
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	if (n <= 0) {
		G.dev_eof = n == 0; /* device mode: the host side disconnected */
		conn_close();
		return;
	}
	G.in.len += (size_t)n;
	G.dispatching = 1;
	while (G.conn == fd && G.in.len >= HDR) {
		const uint8_t *h = (uint8_t *)G.in.p + G.in.off;
		uint32_t l = get32(h), chan = get32(h + 8);
		if (l > MAX_PAYLOAD) { /* cannot resynchronise: tell the edge and hang up */
			send_err(chan, EMSGSIZE, "frame of %u bytes exceeds %u", l, MAX_PAYLOAD);
			conn_flush();
			conn_close();
			break;
		}
		if (G.in.len < HDR + l)
			break;
		handle_frame(h[4], chan, h + HDR, l);
		if (G.conn == fd)
			bq_consume(&G.in, HDR + l);
	}
	G.dispatching = 0;
	if (G.conn != fd)
		bq_free(&G.in);
	else
		bq_trim(&G.in);
}

static void conn_accept(void)
{
	for (;;) {
		int fd = accept4(G.lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS)
				G.accept_pause = now_ms() + 100; /* else poll() would spin on the listener */
			return;
		}
		conn_close(); /* a new connection replaces the old one (the edge restarted) */
		bq_free(&G.in);
		G.conn = fd;
		G.gen++;
	}
}

/* Device mode, no connection: the port polled readable or hung up. While the host side is
 * disconnected the port polls POLLHUP at once, so absent hosts are probed on a timer (with
 * SIGIO as the early wake-up) instead of being polled continuously. */
static void dev_event(short re)
{
	if (G.conn >= 0)
		return;
	if (G.dstate == DS_DRAIN || (re & (POLLHUP | POLLERR))) {
		ssize_t n;
		while ((n = read(G.dfd, scratch, sizeof scratch)) > 0) /* stale or unwanted input */
			;
		if (n == 0 || (re & (POLLHUP | POLLERR)) || (errno != EAGAIN && errno != EINTR)) {
			G.dstate = DS_AWAY; /* the host is gone: wait for it to come back */
			G.dev_retry = now_ms() + G.dev_backoff;
			G.dev_backoff = G.dev_backoff * 2 > DEV_BACKOFF_MAX ? DEV_BACKOFF_MAX : G.dev_backoff * 2;
		}
		return;
	}
	/* the host is connected and sent something: a new connection, as if just accepted */
	fcntl(G.dfd, F_SETFL, fcntl(G.dfd, F_GETFL) & ~O_ASYNC);
	bq_free(&G.in);
	G.conn = G.dfd;
	G.gen++;
	G.dev_backoff = 1;
	conn_read();
}

/* ------------------------------------------------------------------ main loop */

/* Paced producers: retained exec output and file reads, queued while the queue is short. */
static void pump_all(void)
{
	for (struct exec *e = G.execs, *nx; e; e = nx) {
		nx = e->next;
		exec_pump(e);
	}
	if (G.evict_due) { /* not inside the loop above: eviction may free any exec */
		G.evict_due = 0;
		exec_evict(NULL);
	}
	for (struct freader **pp = &G.readers; *pp;) {
		struct freader *r = *pp;
		if (reader_pump(r)) {
			*pp = r->next;
			free(r);
			G.nreaders--;
		} else {
			pp = &r->next;
		}
	}
}

/* Is a paced producer waiting for room in the outgoing queue? */
static int pump_pending(void)
{
	if (G.conn < 0)
		return 0;
	for (struct freader *r = G.readers; r; r = r->next)
		if (r->gen == G.gen)
			return 1;
	for (struct exec *e = G.execs; e; e = e->next)
		if (attached(e)) {
			int unsent = e->sent[0] < e->out[0].len || e->sent[1] < e->out[1].len;
			if (unsent ? e->credit != 0 : e->phase == PH_DONE && !e->exit_sent)
				return 1; /* an exec out of credit waits for CREDIT, not for room */
		}
	return 0;
}

static void sig_event(void)
{
	struct signalfd_siginfo si;
	while (read(G.sfd, &si, sizeof si) == (ssize_t)sizeof si) {
		/* As PID 1, only a signal from outside the sandbox's pid namespace (the runtime:
		 * sender pid 0 here) stops us; a command's `kill 1` is ignored. SIGKILL/SIGSTOP
		 * from inside never reach an init at all (the kernel protects it). */
		if ((si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT) && (getpid() != 1 || si.ssi_pid == 0))
			_exit(0); /* supervisors get SIGTERM via PDEATHSIG and kill their trees */
		if (si.ssi_signo == SIGIO && G.dfd >= 0 && G.conn < 0 && G.dstate == DS_AWAY)
			G.dev_retry = 0; /* the port changed (host (re)connected?): probe now */
	}
	while (waitpid(-1, NULL, WNOHANG) > 0) /* supervisors and orphans alike */
		;
}

static void poll_add(size_t *n, int fd, short ev, int kind, struct proc *p)
{
	if (*n == G.pcap) {
		size_t nc = G.pcap ? G.pcap * 2 : 64;
		struct pollfd *np = realloc(G.pfd, nc * sizeof *np);
		if (np)
			G.pfd = np;
		struct slot *ns = realloc(G.slot, nc * sizeof *ns);
		if (ns)
			G.slot = ns;
		if (!np || !ns)
			return; /* skipped this round; tried again next iteration */
		G.pcap = nc;
	}
	G.pfd[*n] = (struct pollfd){ .fd = fd, .events = ev };
	G.slot[*n] = (struct slot){ kind, p, NULL };
	(*n)++;
}

static int next_timeout(int64_t now)
{
	int64_t best = -1;
#define CAND(t) do { int64_t t_ = (t); if (best < 0 || t_ < best) best = t_; } while (0)
	for (struct exec *e = G.execs; e; e = e->next)
		if (e->phase != PH_DONE && e->deadline && !e->timed_out)
			CAND(e->deadline);
	for (struct proc *p = G.procs; p; p = p->next) {
		if (p->zombie)
			continue;
		if (p->have_status && (p->out[0] >= 0 || p->out[1] >= 0))
			CAND(p->exited_at + LINGER_MS);
		if (!p->have_status && p->kill_deadline)
			CAND(p->kill_deadline);
	}
	if (G.accept_pause > now)
		CAND(G.accept_pause);
	if (G.dfd >= 0 && G.conn < 0 && G.dstate == DS_AWAY && G.dev_retry > now)
		CAND(G.dev_retry);
	if (!G.out.len && pump_pending()) /* queue drained, producers still waiting */
		CAND(now);
#undef CAND
	if (best < 0)
		return -1;
	return best <= now ? 0 : (best - now > 60000 ? 60000 : (int)(best - now));
}

static void loop(void)
{
	for (;;) {
		size_t n = 0;
		watch_reap();             /* first: an ended watch's ERROR is then flushed below */
		poll_add(&n, G.sfd, POLLIN, SL_SIG, NULL);
		if (G.conn >= 0) /* before the listener: finish the old connection's frames first */
			poll_add(&n, G.conn, POLLIN | (G.out.len ? POLLOUT : 0), SL_CONN, NULL);
		if (G.lfd >= 0 && now_ms() >= G.accept_pause)
			poll_add(&n, G.lfd, POLLIN, SL_LISTEN, NULL);
		if (G.dfd >= 0 && G.conn < 0 && (G.dstate == DS_DRAIN || now_ms() >= G.dev_retry))
			poll_add(&n, G.dfd, POLLIN, SL_DEV, NULL);
		for (struct proc *p = G.procs; p; p = p->next) {
			if (p->zombie)
				continue;
			if (p->ctl >= 0)
				poll_add(&n, p->ctl, POLLIN, SL_CTL, p);
			if (p->out[0] >= 0)
				poll_add(&n, p->out[0], POLLIN, SL_OUT0, p);
			if (p->out[1] >= 0)
				poll_add(&n, p->out[1], POLLIN, SL_OUT1, p);
			if (p->in >= 0 && p->inq.len)
				poll_add(&n, p->in, POLLOUT, SL_IN, p);
		}
		if (G.out.len < WATCH_OUT_MAX) /* else the events wait in the kernel's queue */
			for (struct watch *w = G.watches; w; w = w->next) {
				size_t before = n;
				poll_add(&n, w->ifd, POLLIN, SL_WATCH, NULL);
				if (n > before)
					G.slot[before].w = w;
			}
		if (poll(G.pfd, n, next_timeout(now_ms())) < 0 && errno != EINTR) {
			perror("dsec-agent: poll");
			_exit(1);
		}
		for (size_t i = 0; i < n; i++) {
			struct pollfd *pf = &G.pfd[i];
			struct proc *p = G.slot[i].p;
			if (!pf->revents)
				continue;
			/* handlers may close fds or finish procs: re-check ownership of the fd */
			switch (G.slot[i].kind) {
			case SL_SIG: sig_event(); break;
			case SL_LISTEN: conn_accept(); break;
			case SL_DEV: dev_event(pf->revents); break;
			case SL_CONN:
				if (pf->fd != G.conn)
					break;
				if (pf->revents & POLLOUT)
					conn_flush();
				if (G.conn == pf->fd && (pf->revents & (POLLIN | POLLHUP | POLLERR)))
					conn_read();
				break;
			case SL_CTL:
				if (!p->zombie && p->ctl == pf->fd)
					proc_ctl(p);
				break;
			case SL_OUT0: case SL_OUT1: {
				int st = G.slot[i].kind == SL_OUT1;
				if (!p->zombie && p->out[st] == pf->fd)
					proc_read(p, st, 4);
				break;
			}
			case SL_IN:
				if (!p->zombie && p->in == pf->fd)
					proc_in_flush(p);
				break;
			case SL_WATCH: /* watches are freed only by watch_reap, before the next poll */
				if (G.slot[i].w->chan && !G.slot[i].w->ended && G.slot[i].w->gen == G.gen)
					watch_read(G.slot[i].w);
				break;
			}
		}
		int64_t now = now_ms();
		for (struct exec *e = G.execs; e; e = e->next)
			if (e->phase != PH_DONE && e->deadline && !e->timed_out && now >= e->deadline)
				exec_timeout(e);
		for (struct proc *p = G.procs; p; p = p->next)
			proc_tick(p, now);
		for (struct proc **pp = &G.procs; *pp;) { /* free finished procs */
			struct proc *p = *pp;
			if (p->zombie) {
				*pp = p->next;
				free(p);
			} else {
				pp = &p->next;
			}
		}
		/* Refill while the socket takes everything: once the queue is empty no POLLOUT
		 * would wake us for the rest (bounded, so other fds get their turn). */
		for (int round = 0; round < 16; round++) {
			pump_all();
			conn_flush();
			if (G.out.len || !pump_pending())
				break;
		}
	}
}

/* ------------------------------------------------------------------ supervisor (S) */

static void s_msg(int type, int a, int b)
{
	struct smsg m = { type, a, b };
	send(3, &m, sizeof m, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* SIGKILL every direct child (orphans of the command's tree were reparented to us). */
static void kill_children(void)
{
	char path[64], buf[8192];
	pid_t me = getpid();
	snprintf(path, sizeof path, "/proc/%d/task/%d/children", (int)me, (int)me);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd >= 0) {
		ssize_t n = read(fd, buf, sizeof buf - 1);
		close(fd);
		if (n >= 0) {
			buf[n] = 0;
			for (char *s = buf, *end; *s; s = end) {
				long pid = strtol(s, &end, 10);
				if (end == s)
					break;
				if (pid > 0)
					kill((pid_t)pid, SIGKILL);
			}
			return;
		}
	}
	DIR *d = opendir("/proc"); /* no CONFIG_PROC_CHILDREN: scan for our children */
	if (!d)
		return;
	struct dirent *de;
	while ((de = readdir(d))) {
		long pid = atol(de->d_name);
		if (pid <= 0)
			continue;
		snprintf(path, sizeof path, "/proc/%ld/stat", pid);
		fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		ssize_t n = read(fd, buf, sizeof buf - 1);
		close(fd);
		if (n <= 0)
			continue;
		buf[n] = 0;
		char *rp = strrchr(buf, ')'); /* comm may contain spaces and parentheses */
		long ppid;
		if (rp && sscanf(rp + 1, " %*c %ld", &ppid) == 1 && ppid == me)
			kill((pid_t)pid, SIGKILL);
	}
	closedir(d);
}

/* Kill C's process group, then every process reparented to us, until none is left. */
static void kill_tree(pid_t c, int *c_alive)
{
	if (*c_alive)
		kill(-c, SIGKILL);
	for (;;) {
		kill_children();
		int st;
		pid_t w = waitpid(-1, &st, 0);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			return; /* ECHILD: nothing left */
		}
		if (w == c && *c_alive) {
			*c_alive = 0;
			s_msg(SM_STATUS, st, 0);
		}
	}
}

/* Limits of every command: RLIMIT_CORE 0, RLIMIT_NOFILE and RLIMIT_FSIZE (soft = hard, so
 * root without CAP_SYS_RESOURCE cannot raise them again). Never raises a limit. */
static int child_limits(unsigned long nofile, unsigned long long fsize)
{
	struct rlimit rl = { 0, 0 };
	if (setrlimit(RLIMIT_CORE, &rl) < 0)
		return -1;
	if (nofile && getrlimit(RLIMIT_NOFILE, &rl) == 0) {
		rlim_t n = (rlim_t)nofile < rl.rlim_max ? (rlim_t)nofile : rl.rlim_max;
		rl.rlim_cur = rl.rlim_max = n;
		if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
			return -1;
	}
	if (fsize && getrlimit(RLIMIT_FSIZE, &rl) == 0) {
		rlim_t n = (rlim_t)fsize < rl.rlim_max ? (rlim_t)fsize : rl.rlim_max;
		rl.rlim_cur = rl.rlim_max = n;
		if (setrlimit(RLIMIT_FSIZE, &rl) < 0)
			return -1;
	}
	return 0;
}

static void child_exec(uid_t uid, gid_t gid, const char *cwd, char **argv, int ep,
		       int ll_abi, unsigned long nofile, unsigned long long fsize)
{
	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	int stage = ST_SETSID;
	if (setsid() < 0)
		goto fail;
	int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC); /* before Landlock: /proc */
	if (fd >= 0) {
		if (write(fd, "0", 1) < 0) { /* best effort */ }
		close(fd);
	}
	stage = ST_RLIMIT;
	if (child_limits(nofile, fsize) < 0)
		goto fail;
	stage = ST_LANDLOCK; /* fd 4: the agent's ruleset; a new domain for this command alone */
	if (ll_abi && ll_enforce(4) < 0)
		goto fail; /* the agent saw Landlock working: fail closed */
	if (ll_abi)
		close(4);
	if (geteuid() == 0) {
		stage = ST_SETGROUPS;
		if (setgroups(0, NULL) < 0)
			goto fail;
		stage = ST_SETGID;
		if (setgid(gid) < 0)
			goto fail;
		stage = ST_SETUID;
		if (setuid(uid) < 0)
			goto fail;
	} else if (uid != geteuid() || gid != getegid()) {
		stage = ST_SETUID;
		errno = EPERM;
		goto fail;
	}
	stage = ST_CHDIR;
	if (chdir(cwd) < 0)
		goto fail;
	stage = ST_EXEC;
	execve(argv[0], argv, environ);
fail:;
	int m[2] = { errno, stage };
	if (write(ep, m, sizeof m) < 0) { /* nothing left to do */ }
	_exit(127);
}

/* argv: self --supervise UID GID CWD AGENT_PID LL_ABI:NOFILE:FSIZE cmd... ;
 * fds 0-2 for C, 3 = control socket. */
static int supervise_main(int argc, char **argv)
{
	if (argc < 8)
		return 2;
	uid_t uid = (uid_t)strtoul(argv[2], NULL, 10);
	gid_t gid = (gid_t)strtoul(argv[3], NULL, 10);
	const char *cwd = argv[4];
	pid_t agent = (pid_t)atoi(argv[5]);
	int ll_abi = 0;
	unsigned long nofile = 0;
	unsigned long long fsize = 0;
	if (sscanf(argv[6], "%d:%lu:%llu", &ll_abi, &nofile, &fsize) != 3)
		return 2;
	char **cargv = argv + 7;

	prctl(PR_SET_DUMPABLE, 0); /* like the agent: no ptrace, no /proc/PID/{fd,mem} from commands */

	fcntl(3, F_SETFD, FD_CLOEXEC); /* C must never see the control socket */
	cloexec_from3();
	sigset_t ss;
	sigemptyset(&ss);
	sigaddset(&ss, SIGCHLD);
	sigaddset(&ss, SIGTERM);
	sigprocmask(SIG_BLOCK, &ss, NULL);
	int sfd = signalfd(-1, &ss, SFD_CLOEXEC | SFD_NONBLOCK);
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	prctl(PR_SET_PDEATHSIG, SIGTERM); /* agent gone: take the tree down with us */
	if (getppid() != agent)
		return 1;
	int ep[2];
	if (sfd < 0 || pipe2(ep, O_CLOEXEC) < 0) {
		s_msg(SM_PID, -errno, 0);
		return 1;
	}
	pid_t c = fork();
	if (c == 0)
		child_exec(uid, gid, cwd, cargv, ep[1], ll_abi, nofile, fsize);
	s_msg(SM_PID, c < 0 ? -errno : c, 0);
	if (c < 0)
		return 1;
	close(ep[1]);
	if (ll_abi)
		close(4); /* only C needed the ruleset */
	/* drop our copies of C's stdio so EOF depends on C's tree only */
	int nul = open("/dev/null", O_RDWR | O_CLOEXEC);
	for (int i = 0; i < 3; i++)
		if (nul < 0 || dup3(nul, i, 0) < 0)
			close(i);
	int m[2];
	ssize_t r;
	while ((r = read(ep[0], m, sizeof m)) < 0 && errno == EINTR)
		;
	if (r == (ssize_t)sizeof m)
		s_msg(SM_STARTERR, m[0], m[1]);
	close(ep[0]);

	int c_alive = 1, ctl_open = 1;
	for (;;) {
		struct pollfd pf[2] = { { sfd, POLLIN, 0 }, { ctl_open ? 3 : -1, POLLIN, 0 } };
		if (poll(pf, 2, -1) < 0 && errno != EINTR)
			return 1;
		if (pf[1].revents) {
			char b[16];
			ssize_t n = recv(3, b, sizeof b, MSG_DONTWAIT);
			if (n > 0) { /* kill request */
				kill_tree(c, &c_alive);
				return 0;
			}
			if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
				ctl_open = 0; /* the agent is done with us; keep reaping the background */
				close(3);
			}
		}
		if (pf[0].revents) {
			struct signalfd_siginfo si;
			int term = 0;
			while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si)
				term |= si.ssi_signo == SIGTERM;
			if (term) {
				kill_tree(c, &c_alive);
				return 0;
			}
		}
		for (;;) {
			int st;
			pid_t w = waitpid(-1, &st, WNOHANG);
			if (w > 0) {
				if (w == c && c_alive) {
					c_alive = 0;
					s_msg(SM_STATUS, st, 0);
				}
				continue;
			}
			if (w < 0 && errno == ECHILD)
				return 0; /* C and all its leftovers are gone */
			break;
		}
	}
}

/* ------------------------------------------------------------------ start-up */

static void usage(void)
{
	fputs("usage: dsec-agent [-w WORKDIR] [-u UID] [-g GID] [-f LISTEN_FD | -D DEVICE] [-s SHELL]\n"
	      "                  [-L 0|1] [-n NOFILE] [-F FSIZE_BYTES] [-R RETAIN_BYTES]\n", stderr);
	exit(2);
}

int main(int argc, char **argv)
{
	if (argc > 1 && !strcmp(argv[1], "--supervise"))
		return supervise_main(argc, argv);
	int opt;
	while ((opt = getopt(argc, argv, "w:u:g:f:s:L:n:F:D:R:")) != -1) {
		switch (opt) {
		case 'w': G.workdir = optarg; break;
		case 'u': G.uid = (uid_t)strtoul(optarg, NULL, 10); break;
		case 'g': G.gid = (gid_t)strtoul(optarg, NULL, 10); break;
		case 'f': G.lfd = atoi(optarg); break;
		case 's': G.shell = optarg; break;
		case 'L': G.ll_abi = atoi(optarg) ? -1 : 0; break;
		case 'n': G.nofile = strtoul(optarg, NULL, 10); break;
		case 'F': G.fsize = strtoull(optarg, NULL, 10); break;
		case 'D': G.dev = optarg; break;
		case 'R': G.retain_max = (size_t)strtoull(optarg, NULL, 10); break;
		default: usage();
		}
	}
	if (G.workdir[0] != '/' || strlen(G.workdir) >= PATH_MAX - 64)
		usage();
	umask(022);
	/* Nothing in the sandbox may ptrace us or open /proc/1/{fd,environ,mem} (our own stderr
	 * is the host's init log, fd 3 the edge's socket): without CAP_SYS_PTRACE, which no
	 * sandbox process has, a non-dumpable process is off limits even to root. */
	prctl(PR_SET_DUMPABLE, 0);
	/* Device mode (a VM guest, where root has every capability): no command may do port
	 * I/O (iopl/ioperm, /dev/port: CAP_SYS_RAWIO 17; its writes to the serial port bypass
	 * Landlock) nor load a module that would (CAP_SYS_MODULE 16). Out of the bounding set,
	 * no exec regains them. A container's runtime never grants them in the first place. */
	if (G.dev && (prctl(PR_CAPBSET_DROP, 17, 0, 0, 0) < 0 || prctl(PR_CAPBSET_DROP, 16, 0, 0, 0) < 0)) {
		perror("dsec-agent: PR_CAPBSET_DROP");
		return 1;
	}
	if (G.ll_abi) {
		int abi = ll_probe();
		G.ll_abi = abi >= LL_MIN_ABI ? abi : 0;
		if (!G.ll_abi) /* logged once; seccomp, capabilities, mounts still apply */
			fprintf(stderr, "dsec-agent: Landlock %s: commands run without it\n",
				abi ? "ABI 1 is too old (need 2)" : "is not available");
	}
	for (int i = 0; i < 3; i++) /* pipes must never land on 0..2 */
		if (fcntl(i, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0)
			_exit(1);
	int listening = 0;
	socklen_t sl = sizeof listening;
	if (G.dev) {
		G.lfd = -1; /* the port is the one connection; no listener */
	} else if (getsockopt(G.lfd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &sl) < 0 || !listening) {
		fprintf(stderr, "dsec-agent: fd %d is not a listening socket\n", G.lfd);
		return 1;
	}
	cloexec_from3(); /* nothing the agent inherited may leak into commands */
	if (G.lfd >= 0)
		set_nonblock(G.lfd);
	signal(SIGPIPE, SIG_IGN);
	sigset_t ss;
	sigemptyset(&ss);
	sigaddset(&ss, SIGCHLD);
	sigaddset(&ss, SIGTERM);
	sigaddset(&ss, SIGINT);
	if (G.dev)
		sigaddset(&ss, SIGIO); /* O_ASYNC on the port: the host side (re)connected */
	sigprocmask(SIG_BLOCK, &ss, NULL);
	G.sfd = signalfd(-1, &ss, SFD_CLOEXEC | SFD_NONBLOCK);
	if (G.sfd < 0) {
		perror("dsec-agent: signalfd");
		return 1;
	}
	if (G.dev) {
		G.dfd = open(G.dev, O_RDWR | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
		if (G.dfd < 0) {
			fprintf(stderr, "dsec-agent: open %s: %s\n", G.dev, strerror(errno));
			return 1;
		}
		fcntl(G.dfd, F_SETOWN, getpid());
		dev_detach(DS_AWAY); /* probe at once: the host may already be connected */
	}
	if (getpid() != 1) {
		prctl(PR_SET_CHILD_SUBREAPER, 1); /* orphans come to us as they would to PID 1 */
	} else {
		int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
		if (fd >= 0) { /* the OOM killer should pick a command, not the sandbox's init */
			if (write(fd, "-1000", 5) < 0) { /* best effort */ }
			close(fd);
		}
	}
	if (setgroups(0, NULL) < 0 && errno != EPERM)
		perror("dsec-agent: setgroups");
	struct stat st;
	if (stat(G.workdir, &st) < 0) {
		char wd[PATH_MAX];
		int created = 0;
		snprintf(wd, sizeof wd, "%s", G.workdir);
		size_t n = strlen(wd);
		while (n > 1 && wd[n - 1] == '/')
			wd[--n] = 0;
		int err = mkdirs(wd, n, 0755, &created);
		if (err)
			fprintf(stderr, "dsec-agent: mkdir %s: %s\n", wd, strerror(err));
		else if (created && (chown(wd, G.uid, G.gid) < 0 || chmod(wd, 0755) < 0))
			perror("dsec-agent: chown workdir");
	}
	if (chdir("/") < 0) { /* hold no directory busy */ }
	/* supervisors are this binary re-executed: exactly this file, even if replaced on disk */
	G.self = "/proc/self/exe";
	G.self_alt = argv[0][0] == '/' ? argv[0] : NULL;
	loop();
	return 0;
}
