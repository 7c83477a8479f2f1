/* dsec-agent: frame dispatch and the main loop. One part of the agent's single translation unit (dsec-agent.c). */
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
	case T_RESIZE:
		h_resize(chan, p, n);
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
		if (p->have_status && (p->out[0] >= 0 || p->out[1] >= 0) &&
		    !(p->pty && !proc_room(p) && attached(p->owner))) /* paced: CREDIT wakes us */
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
			if (p->out[0] >= 0 && proc_room(p))
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
