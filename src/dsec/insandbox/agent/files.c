/* dsec-agent: file operations and the VM guest refresh. One part of the agent's single translation unit (dsec-agent.c). */
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
	/* The temporary's name says whether the write creates the file ('c') or replaces it ('w'):
	 * directory watches (watch_read) show the pair as the events a plain write would make,
	 * without a table of writes in flight. */
	struct stat st;
	char kind = fstatat(dfd, base, &st, AT_SYMLINK_NOFOLLOW) == 0 ? 'w' : 'c';
	for (int tries = 0; tries < 5; tries++) {
		random_hex(suffix, 8);
		if (snprintf(tmp, sizeof tmp, ".%s" DSEC_TMP_TAG "%c%s", base, kind, suffix) > NAME_MAX) {
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
