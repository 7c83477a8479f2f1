/* dsec-agent: request fields and the EXEC family of requests. One part of the agent's single translation unit (dsec-agent.c). */
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
static char **build_env(const struct fields *f, uid_t uid, int pty, int *err, const char **why)
{
	char home[PATH_MAX + 8], user[32], logname[32];
	snprintf(home, sizeof home, "HOME=%s", uid == 0 ? "/root" : G.workdir);
	snprintf(user, sizeof user, "USER=%s", uid == 0 ? "root" : "sandbox");
	snprintf(logname, sizeof logname, "LOGNAME=%s", uid == 0 ? "root" : "sandbox");
	const char *defs[] = { "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
			       home, user, logname, "LANG=C.UTF-8",
			       pty ? "TERM=xterm-256color" : "TERM=dumb" };
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
	unsigned cols = 0, rows = 0; /* PTY: u16 columns, u16 rows */
	if (f->has[F_PTY]) {
		if (f->n[F_PTY] != 4 || !(cols = get16(f->v[F_PTY])) || !(rows = get16(f->v[F_PTY] + 2))) {
			send_err(chan, EINVAL, "PTY must be u16 columns and u16 rows, both > 0");
			return;
		}
		if (f->has[F_SESSION]) {
			send_err(chan, EINVAL, "PTY is not supported with SESSION");
			return;
		}
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
	if (!(env = build_env(f, uid, cols > 0, &err, &why))) {
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
	e->pty = cols > 0;
	e->uid = uid;
	e->gid = gid;
	e->deadline = timeout ? now_ms() + timeout : 0;
	e->cwd = cwd;
	cwd = NULL;

	if (!name) {
		char *av[] = { (char *)pick_shell(), "-c", cmd, NULL };
		int want_in = f->has[F_STDIN] || keep_in || e->pty, master = -1;
		if (e->pty && (master = pty_open(cols, rows)) < 0) {
			send_err(chan, errno, "pty: %s", strerror(errno));
			goto out;
		}
		struct proc *p = proc_spawn(PK_EXEC, e, uid, gid, e->cwd ? e->cwd : G.workdir, av, env, want_in, master, &err);
		if (!p) {
			if (master >= 0)
				close(master);
			send_err(chan, err, "spawn: %s", strerror(err));
			goto out;
		}
		if (f->has[F_STDIN] && f->n[F_STDIN])
			bq_append(&p->inq, f->v[F_STDIN], f->n[F_STDIN]);
		if (!keep_in && !e->pty) /* a terminal's input stays open while it runs */
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
		struct proc *p = proc_spawn(PK_CHECK, e, uid, gid, "/", av, env, 1, -1, &err);
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
		if (e->pty) /* EOF on a terminal is the ^D the client types, not a hang-up */
			return;
		p->in_close = 1;
	} else if (p->inq.len + n > STDIN_QMAX || bq_append(&p->inq, d, n) < 0) {
		send_err(chan, ENOBUFS, "stdin queue full, %u bytes dropped", n);
		return;
	}
	proc_in_flush(p);
}

/* RESIZE: the terminal's new size; the kernel sends SIGWINCH to its foreground process group. */
static void h_resize(uint32_t chan, const uint8_t *d, uint32_t n)
{
	struct exec *e = exec_find(chan);
	/* no ERROR on an exec's chan: it would end the edge's stream of that exec */
	if (!e || !e->pty || e->phase != PH_RUN || !e->proc || n != 4 || !get16(d) || !get16(d + 2))
		return;
	struct proc *p = e->proc;
	int fd = p->in >= 0 ? p->in : p->out[0];
	struct winsize ws = { .ws_row = get16(d + 2), .ws_col = get16(d) };
	if (fd >= 0)
		ioctl(fd, TIOCSWINSZ, &ws);
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
	if (more == CREDIT_LET_GO)
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
