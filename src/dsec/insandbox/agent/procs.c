/* dsec-agent: supervised processes and shell sessions. One part of the agent's single translation unit (dsec-agent.c). */
/* ------------------------------------------------------------------ supervised processes */

#ifndef TIOCGPTPEER
#define TIOCGPTPEER _IO('T', 0x41)
#endif

/* A new terminal of cols x rows: its master (non-blocking, close-on-exec), or -1 with errno. */
static int pty_open(unsigned cols, unsigned rows)
{
	int m = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
	if (m < 0)
		return -1;
	struct winsize ws = { .ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols };
	if (grantpt(m) < 0 || unlockpt(m) < 0 || ioctl(m, TIOCSWINSZ, &ws) < 0) {
		int e = errno;
		close(m);
		errno = e;
		return -1;
	}
	set_nonblock(m);
	return m;
}

/* The slave side of `master`, opened through the master itself (TIOCGPTPEER: no path lookup
 * in /dev/pts, which a command could have swapped), by name on kernels before 4.13. */
static int pty_slave(int master)
{
	int fd = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
	if (fd >= 0 || (errno != EINVAL && errno != ENOTTY))
		return fd;
	char name[64];
	if (ptsname_r(master, name, sizeof name))
		return -1;
	return open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
}

/* `master` >= 0: C gets the terminal's slave side as 0/1/2 (and as its controlling tty); the
 * agent reads and writes the master (its own fd, not closed here). Else pipes. */
static struct proc *proc_spawn(int kind, void *owner, uid_t uid, gid_t gid, const char *cwd,
			       char *const *cargv, char *const *envp, int want_in, int master, int *err)
{
	int o[2] = { -1, -1 }, e[2] = { -1, -1 }, in[2] = { -1, -1 }, sp[2] = { -1, -1 }, slave = -1;
	char **av = NULL;
	struct proc *p = calloc(1, sizeof *p);
	if (!p) {
		*err = ENOMEM;
		return NULL;
	}
	if (master >= 0) {
		if ((slave = pty_slave(master)) < 0 || socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp)) {
			*err = errno;
			goto fail;
		}
	} else if (pipe2(o, O_CLOEXEC) || pipe2(e, O_CLOEXEC) || (want_in && pipe2(in, O_CLOEXEC)) ||
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
	snprintf(os, sizeof os, "%d:%lu:%llu:%d", G.ll_abi, G.nofile, G.fsize, master >= 0);
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
	if (slave >= 0) {
		for (int i = 0; i < 3; i++)
			posix_spawn_file_actions_adddup2(&fa, slave, i);
	} else {
		if (want_in)
			posix_spawn_file_actions_adddup2(&fa, in[0], 0);
		else
			posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
		posix_spawn_file_actions_adddup2(&fa, o[1], 1);
		posix_spawn_file_actions_adddup2(&fa, e[1], 2);
	}
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
	xclose(&o[1]);
	xclose(&e[1]);
	close(sp[1]);
	xclose(&in[0]);
	p->kind = kind;
	p->owner = owner;
	p->ctl = sp[0];
	set_nonblock(p->ctl);
	if (slave >= 0) { /* the master's reads end with EIO once C's tree closed every slave fd */
		close(slave);
		p->pty = 1;
		p->out[0] = master;
		p->out[1] = -1;
		if ((p->in = fcntl(master, F_DUPFD_CLOEXEC, 5)) >= 0)
			set_nonblock(p->in);
	} else {
		p->out[0] = o[0];
		p->out[1] = e[0];
		p->in = want_in ? in[1] : -1;
		set_nonblock(p->out[0]);
		set_nonblock(p->out[1]);
		if (p->in >= 0)
			set_nonblock(p->in);
	}
	p->next = G.procs;
	G.procs = p;
	return p;
fail:
	free(av);
	xclose(&slave);
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

/* How much C's output may be read now. A terminal's output is paced: what the edge has not
 * taken stays within the exec's cap here, beyond that it waits in the kernel and C blocks in
 * write(), as on a terminal nobody reads. Pipes are read at once (their output is capped). */
static size_t proc_room(struct proc *p)
{
	if (!p->pty || !p->owner)
		return sizeof scratch;
	struct exec *e = p->owner;
	size_t unsent = e->out[0].len - e->sent[0];
	size_t room = unsent >= e->cap ? 0 : e->cap - unsent;
	return room < sizeof scratch ? room : sizeof scratch;
}

/* Read from one output pipe (or a terminal's master); max_reads bounds the work per call. */
static void proc_read(struct proc *p, int st, int max_reads)
{
	while (p->out[st] >= 0 && max_reads-- > 0) {
		size_t want = proc_room(p);
		if (!want)
			return;
		ssize_t n = read(p->out[st], scratch, want);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		if (n <= 0) { /* EOF; EIO: a terminal whose slave side every process closed */
			xclose(&p->out[st]);
			return;
		}
		proc_output(p, st, scratch, (size_t)n);
		if ((size_t)n < want)
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
	if (p->pty && p->out[0] >= 0 && !proc_room(p) && attached(p->owner))
		return; /* C's last output waits for the edge to take what is queued */
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
		s->shell = proc_spawn(PK_SESSION, s, e->uid, e->gid, e->cwd ? e->cwd : G.workdir, av, e->env, 1, -1, &err);
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
