/* dsec-agent: limits, small helpers, Landlock and the state every part shares. One part of the agent's single translation unit (dsec-agent.c). */
/* ------------------------------------------------------------------ limits */

#include "protocol.h"   /* the wire numbers, generated from dsec/agent/protocol.py */

#define OUTQ_DROP (8u << 20)      /* edge not reading: drop the connection */
#define OUTQ_PACE (1u << 20)      /* bulk producers only fill the queue up to here */
#define BQ_KEEP (256u << 10)      /* larger idle buffers are freed */
#define FRAME_CHUNK (256u << 10)  /* max STDOUT/STDERR frame payload */
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
#define WATCH_TMP_MOVES 8         /* FILE_WRITE renames a watch pairs at once (see watch_read) */
#define DSEC_TMP_TAG ".dsec-"     /* FILE_WRITE's temporaries: .NAME.dsec-{c|w}<16 hex> */
#define WATCH_FOUND_MAX (256u << 10) /* reports of what a new directory already held, per read */

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

static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
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
	int pty;                  /* C runs on a terminal: out[0] reads its master, in writes it */
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
	int pty;                  /* PTY exec: out[0] holds only what is not sent yet (paced, see exec_pump) */
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
	uint32_t tmp_cookie[WATCH_TMP_MOVES]; /* renames of FILE_WRITE temporaries whose IN_MOVED_TO */
	char tmp_kind[WATCH_TMP_MOVES];       /* ... is still to come: 'c' creates, 'w' replaces */
	unsigned tmp_next;
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
