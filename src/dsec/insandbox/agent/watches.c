/* dsec-agent: directory watches. One part of the agent's single translation unit (dsec-agent.c). */
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

/* 'c' or 'w' if `nm` is a FILE_WRITE temporary (.NAME.dsec-{c|w}<16 lowercase hex>), else 0. */
static char dsec_tmp(const char *nm)
{
	size_t nl = strlen(nm), tl = sizeof DSEC_TMP_TAG - 1;
	if (nl < 2 + tl + 1 + 16 || nm[0] != '.')
		return 0;
	const char *t = nm + nl - 16 - 1 - tl;
	if (memcmp(t, DSEC_TMP_TAG, tl) || (t[tl] != 'c' && t[tl] != 'w'))
		return 0;
	for (const char *h = t + tl + 1; *h; h++)
		if (!((*h >= '0' && *h <= '9') || (*h >= 'a' && *h <= 'f')))
			return 0;
	return t[tl];
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
		/* FILE_WRITE writes a temporary sibling and renames it over the file (atomic): show
		 * that as a plain write of the file would (CREATE of a new one, then MODIFY), not the
		 * temporary's CREATE/MODIFY/ATTRIB/MOVED_FROM. Its rename's two halves pair by cookie
		 * (usually adjacent; a few are kept in case a read splits them). */
		uint32_t mask = ev->mask & (WATCH_MASK | IN_ISDIR);
		char tk = ev->mask & IN_ISDIR ? 0 : dsec_tmp(ev->name);
		if (tk) {
			if ((ev->mask & IN_MOVED_FROM) && ev->cookie) {
				w->tmp_cookie[w->tmp_next] = ev->cookie;
				w->tmp_kind[w->tmp_next] = tk;
				w->tmp_next = (w->tmp_next + 1) % WATCH_TMP_MOVES;
			}
			continue;
		}
		char wk = 0;        /* 'c'/'w': this IN_MOVED_TO puts a written file in place */
		for (int k = 0; (mask & IN_MOVED_TO) && ev->cookie && k < WATCH_TMP_MOVES; k++) {
			if (w->tmp_cookie[k] == ev->cookie) {
				wk = w->tmp_kind[k];
				w->tmp_cookie[k] = 0;
				break;
			}
		}
		const char *rel = w->dirs[i].rel;
		int nn = snprintf(name, sizeof name, "%s%s%s", rel, *rel ? "/" : "", ev->name);
		if (nn < 0 || (size_t)nn >= sizeof name || nn > 0xffff)
			continue;
		if (wk) {
			if ((wk == 'c' && ev_append(&b, IN_CREATE, name, (size_t)nn) < 0) ||
			    ev_append(&b, IN_MODIFY, name, (size_t)nn) < 0)
				break;
			continue;
		}
		if (ev_append(&b, mask, name, (size_t)nn) < 0)
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
