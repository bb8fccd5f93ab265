/*
 * polar_gym sandbox helper: applies resource limits, optionally starts the "gateway only" relay, then execs a command.
 *
 *   relay [-n NPROC] [-m DATA_BYTES] [-f FILE_BYTES] [-c CPU,CPU,...] [-l PORT -u SOCKET [-k MAXCONN]] -- CMD...
 *   relay [-J CGROUP_PROCS]... [-S STAGE -B SRC...] [-U UID -G GID] [-W PID] -- bwrap ...  (host side)
 *
 * Host side (the local backend started by root): -J moves this process into a cgroup (its procs file) before
 * anything else, so every sandbox process is counted; -S/-B make a private mount namespace, mount a small tmpfs on
 * STAGE and bind each SRC at STAGE/0, STAGE/1, ... (so bwrap, once it runs as an unprivileged uid, can reach
 * sources whose parents it could not traverse, such as a session directory under a 0700 tree; nothing of this is
 * visible on the host, and STAGE/empty is an empty file to mask secrets with); -U/-G drop to that uid and gid
 * (no supplementary groups, no new privileges) and exec the rest, bwrap, whose user namespace then maps to it.
 * -W PID keeps this process as the sandbox's watchdog for its parent PID (see watch()): bwrap alone leaves a sandbox
 * behind when the process that started it is SIGKILLed at the wrong moment.
 *
 * Limits are set here, inside the sandbox (after its user namespace exists), so RLIMIT_NPROC counts the sandbox's
 * own processes rather than every process of the user on the host. With -l/-u it listens on 127.0.0.1:PORT, forks
 * a relay process that forwards every TCP connection to the Unix socket SOCKET (the gateway's proxy, reached through
 * the session directory), and only then execs CMD, so the proxy is reachable the moment CMD starts. The relay lives
 * in the sandbox's pid namespace and dies with it.
 *
 * The relay is one poll() loop with a fixed buffer per direction: at most MAXCONN (-k, default 64) connections at
 * once (more wait in the listen backlog until one ends), half-close propagated with shutdown(SHUT_WR), no dependency
 * beyond libc (built with -static).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <grp.h>
#include <unistd.h>

#define BUF 65536

struct half {          /* one direction: bytes read from `from`, waiting to be written to `to` */
    char buf[BUF];
    size_t len, off;
    int eof;           /* `from` reached EOF (or failed) */
    int shut;          /* SHUT_WR already sent to `to` */
};

struct conn {
    int fd[2];         /* 0: TCP client inside the sandbox, 1: Unix socket to the gateway */
    struct half h[2];  /* h[0]: fd[0] -> fd[1], h[1]: fd[1] -> fd[0] */
};

static struct conn **conns;
static size_t nconns, capconns, maxconns = 64;

static void die(const char *what) {
    fprintf(stderr, "polar relay: %s: %s\n", what, strerror(errno));
    exit(126);
}

static void set_nonblock(int fd) {
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0) fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

static void close_conn(size_t i) {
    close(conns[i]->fd[0]);
    close(conns[i]->fd[1]);
    free(conns[i]);
    conns[i] = conns[--nconns];
}

static void accept_one(int lfd, const char *path) {
    int c = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (c < 0) return;
    int u = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof sa);
    sa.sun_family = AF_UNIX;
    strncpy(sa.sun_path, path, sizeof sa.sun_path - 1);
    if (u < 0 || connect(u, (struct sockaddr *)&sa, sizeof sa) < 0) {  /* blocking: a local socket answers at once */
        if (u >= 0) close(u);
        close(c);
        return;
    }
    set_nonblock(u);
    int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (nconns == capconns) {
        capconns = capconns ? capconns * 2 : 64;
        conns = realloc(conns, capconns * sizeof *conns);
        if (!conns) die("realloc");
    }
    struct conn *k = calloc(1, sizeof *k);
    if (!k) die("calloc");
    k->fd[0] = c;
    k->fd[1] = u;
    conns[nconns++] = k;
}

/* Move data for one direction; returns -1 when the connection must be dropped. */
static int pump(struct conn *k, int d) {
    struct half *h = &k->h[d];
    int from = k->fd[d], to = k->fd[1 - d];
    if (h->len == 0 && !h->eof) {
        ssize_t n = read(from, h->buf, BUF);
        if (n > 0) {
            h->len = (size_t)n;
            h->off = 0;
        } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
            h->eof = 1;
        }
    }
    while (h->len > 0) {
        ssize_t n = send(to, h->buf + h->off, h->len, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) return 0;
            return -1;
        }
        h->off += (size_t)n;
        h->len -= (size_t)n;
    }
    if (h->eof && !h->shut) {
        shutdown(to, SHUT_WR);
        h->shut = 1;
    }
    return 0;
}

static void serve(int lfd, const char *path) {
    struct pollfd *pfd = NULL;
    size_t cap = 0;
    for (;;) {
        size_t need = 1 + 2 * nconns;
        if (need > cap) {
            cap = need * 2;
            pfd = realloc(pfd, cap * sizeof *pfd);
            if (!pfd) die("realloc");
        }
        pfd[0].fd = lfd;
        pfd[0].events = nconns < maxconns ? POLLIN : 0;  /* at the cap: new connections wait in the backlog */
        for (size_t i = 0; i < nconns; i++) {
            struct conn *k = conns[i];
            for (int s = 0; s < 2; s++) {
                /* socket s: read when its outgoing buffer is empty, write when the other side's buffer has data */
                short ev = 0;
                if (!k->h[s].eof && k->h[s].len == 0) ev |= POLLIN;
                if (k->h[1 - s].len > 0) ev |= POLLOUT;
                pfd[1 + 2 * i + s].fd = k->fd[s];
                pfd[1 + 2 * i + s].events = ev;
            }
        }
        if (poll(pfd, need, -1) < 0) {
            if (errno == EINTR) continue;
            die("poll");
        }
        size_t count = nconns;  /* connections accepted below are polled next round */
        for (size_t i = count; i-- > 0;) {
            short r0 = pfd[1 + 2 * i].revents, r1 = pfd[2 + 2 * i].revents;
            if (!r0 && !r1) continue;
            struct conn *k = conns[i];
            if (pump(k, 0) < 0 || pump(k, 1) < 0 || (k->h[0].shut && k->h[1].shut)) {
                close_conn(i);
                continue;
            }
            /* a reset peer that we can neither read from nor write to any more */
            if (((r0 | r1) & (POLLERR | POLLNVAL)) && k->h[0].len == 0 && k->h[1].len == 0) close_conn(i);
        }
        if (pfd[0].revents & POLLIN) {
            for (int j = 0; j < 64 && nconns < maxconns; j++) {
                size_t before = nconns;
                errno = 0;
                accept_one(lfd, path);
                if (nconns == before && errno == EAGAIN) break;
            }
        }
    }
}

static void limit(int resource, const char *value) {
    struct rlimit rl;
    rl.rlim_cur = rl.rlim_max = (rlim_t)strtoull(value, NULL, 10);
    if (setrlimit(resource, &rl) < 0) die("setrlimit");
}

static void affinity(const char *list) {
    cpu_set_t set;
    CPU_ZERO(&set);
    char *copy = strdup(list), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) CPU_SET(atoi(tok), &set);
    free(copy);
    if (sched_setaffinity(0, sizeof set, &set) < 0) die("sched_setaffinity");
}

static void join_cgroup(const char *procs) {
    int fd = open(procs, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, "0\n", 2) != 2) die(procs);
    close(fd);
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) die(path);
    close(fd);
}

/* A private mount namespace (in a user namespace of our own uid when not root) with STAGE/<i> bound to srcs[i] and
 * an empty file STAGE/empty. Each source is opened after the unshare with O_NOFOLLOW on its last component and
 * bound through its fd, so a symlink put in its place (by a sandbox that owns the parent) is refused, never
 * followed. */
static void stage(const char *root, char **srcs, int n) {
    char path[4096], map[64];
    if (geteuid() != 0) {
        uid_t u = geteuid();
        gid_t g = getegid();
        if (unshare(CLONE_NEWUSER | CLONE_NEWNS) < 0) die("unshare(CLONE_NEWUSER | CLONE_NEWNS)");
        snprintf(map, sizeof map, "%u %u 1\n", u, u);
        write_file("/proc/self/uid_map", map);
        write_file("/proc/self/setgroups", "deny\n");
        snprintf(map, sizeof map, "%u %u 1\n", g, g);
        write_file("/proc/self/gid_map", map);
    } else if (unshare(CLONE_NEWNS) < 0) {
        die("unshare(CLONE_NEWNS)");
    }
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("make / private");
    if (mount("polar-stage", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m") < 0) die(root);
    snprintf(path, sizeof path, "%s/empty", root);
    int e = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0444);
    if (e < 0) die(path);
    close(e);
    for (int i = 0; i < n; i++) {
        struct stat st;
        char fdpath[64];
        int fd = open(srcs[i], O_PATH | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0 || fstat(fd, &st) < 0) die(srcs[i]);
        if (S_ISLNK(st.st_mode)) {
            errno = ELOOP;
            die(srcs[i]);
        }
        snprintf(path, sizeof path, "%s/%d", root, i);
        if (S_ISDIR(st.st_mode)) {
            if (mkdir(path, 0755) < 0) die(path);
        } else {
            int f = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0444);
            if (f < 0) die(path);
            close(f);
        }
        snprintf(fdpath, sizeof fdpath, "/proc/self/fd/%d", fd);
        if (mount(fdpath, path, NULL, MS_BIND | MS_REC, NULL) < 0) die(srcs[i]);
        close(fd);
    }
    if (chdir("/") < 0) die("chdir /");
}

static void drop_to(const char *uid, const char *gid) {
    uid_t u = (uid_t)strtoul(uid, NULL, 10);
    gid_t g = (gid_t)strtoul(gid ? gid : uid, NULL, 10);
    if (setgroups(0, NULL) < 0) die("setgroups");
    if (setresgid(g, g, g) < 0) die("setresgid");
    if (setresuid(u, u, u) < 0) die("setresuid");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die("no_new_privs");
}

/* -W PID: the watchdog between the launching process PID (the gateway) and bwrap. bwrap's --die-with-parent kills
 * the outer bwrap when the gateway dies, and the sandbox's pid 1 when the outer bwrap dies, but pid 1 arms that
 * only after the outer bwrap has written its uid map: an outer bwrap killed before that (a gateway SIGKILLed while
 * sandboxes start) leaves pid 1 blocked for good on an eventfd, reparented to init (seen: sandboxes left running
 * for hours). Here the gateway's death (PR_SET_PDEATHSIG, armed after the uid drop, which clears it; a parent other
 * than PID means the gateway died before that) or the outer bwrap's death by a signal kills this whole process
 * group, and, as a child subreaper, every process it inherits as the outer bwrap dies: pid 1 is killed even when it
 * is not in this group (bwrap's --new-session calls setsid; a pid 1 outside the group once outlived a SIGKILLed
 * gateway under load). Otherwise the watchdog exits with bwrap's exit code. */
static char children_path[64];  /* /proc/self/task/TID/children, set before any signal can arrive */
static volatile pid_t watched = 0;  /* the outer bwrap */

/* SIGKILL every direct child: as a child subreaper, the watchdog inherits the sandbox's pid 1 once the outer bwrap
 * is gone, so a pid 1 outside this group (bwrap's --new-session setsid) is still reached. Only syscalls that are
 * safe in a signal handler. Returns how many it killed. */
static int kill_children(void) {
    char buf[4096];
    int fd = open(children_path, O_RDONLY | O_CLOEXEC), killed = 0;
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    pid_t pid = 0;
    for (char *c = buf; ; c++) {
        if (*c >= '0' && *c <= '9') { pid = pid * 10 + (*c - '0'); continue; }
        if (pid > 0 && kill(pid, SIGKILL) == 0) killed++;
        pid = 0;
        if (!*c) break;
    }
    return killed;
}

static void kill_group(int sig) {
    (void)sig;
    if (watched > 0) kill(watched, SIGKILL);  /* not the group yet: that would kill this process first */
    /* the outer bwrap's children come to us as it dies: kill them until none is left (at most ~2 s) */
    struct timespec pause = {0, 10 * 1000 * 1000};
    for (int round = 0; round < 200; round++) {
        while (waitpid(-1, NULL, WNOHANG) > 0) {}
        if (kill_children() == 0 && waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD) break;
        nanosleep(&pause, NULL);
    }
    kill(-getpgrp(), SIGKILL);  /* whatever else is left in the group, this process included */
    _exit(137);
}

static void watch(pid_t launcher) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = kill_group;
    snprintf(children_path, sizeof children_path, "/proc/self/task/%d/children", (int)getpid());
    if (sigaction(SIGTERM, &sa, NULL) < 0) die("sigaction");
    if (getpgrp() != getpid() && setpgid(0, 0) < 0) die("setpgid");  /* the group killed is never the launcher's */
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0) die("PR_SET_CHILD_SUBREAPER");
    if (prctl(PR_SET_PDEATHSIG, SIGTERM, 0, 0, 0) < 0) die("PR_SET_PDEATHSIG");
    if (getppid() != launcher) kill_group(0);
    pid_t self = getpid(), child = fork();
    if (child < 0) die("fork");
    if (child > 0) watched = child;
    if (child == 0) {
        signal(SIGTERM, SIG_DFL);
        if (prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) < 0) die("PR_SET_CHILD_SUBREAPER");
        if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) die("PR_SET_PDEATHSIG");
        if (getppid() != self) _exit(126);
        return;  /* the caller execs bwrap */
    }
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) die("waitpid");
    if (WIFSIGNALED(status)) kill_group(0);
    exit(WIFEXITED(status) ? WEXITSTATUS(status) : 126);
}

#define MAXSTAGE 64

int main(int argc, char **argv) {
    const char *port = NULL, *path = NULL, *stage_root = NULL, *uid = NULL, *gid = NULL;
    const char *nproc = NULL, *data = NULL, *fsize = NULL, *cpus = NULL;
    char *srcs[MAXSTAGE];
    int nsrcs = 0, opt;
    pid_t launcher = 0;
    while ((opt = getopt(argc, argv, "+n:m:f:c:l:u:k:J:S:B:U:G:W:")) != -1) {
        switch (opt) {
        case 'n': nproc = optarg; break;
        case 'm': data = optarg; break;
        case 'f': fsize = optarg; break;
        case 'c': cpus = optarg; break;
        case 'l': port = optarg; break;
        case 'u': path = optarg; break;
        case 'k': maxconns = (size_t)strtoul(optarg, NULL, 10); break;
        case 'J': join_cgroup(optarg); break;  /* first thing, in command-line order */
        case 'S': stage_root = optarg; break;
        case 'B':
            if (nsrcs == MAXSTAGE) { errno = E2BIG; die("-B"); }
            srcs[nsrcs++] = optarg;
            break;
        case 'U': uid = optarg; break;
        case 'G': gid = optarg; break;
        case 'W': launcher = (pid_t)strtol(optarg, NULL, 10); break;
        default:
            fprintf(stderr, "usage: relay [-n NPROC] [-m BYTES] [-f BYTES] [-c CPUS] [-l PORT -u SOCKET [-k N]] "
                            "[-J PROCS]... [-S STAGE -B SRC...] [-U UID -G GID] [-W PID] -- CMD...\n");
            return 2;
        }
    }
    if (optind >= argc) {
        fprintf(stderr, "polar relay: no command\n");
        return 2;
    }
    if (maxconns < 1) maxconns = 1;
    if (nsrcs && !stage_root) { errno = EINVAL; die("-B needs -S"); }
    if (stage_root) stage(stage_root, srcs, nsrcs);
    if (uid) drop_to(uid, gid);
    if (nproc) limit(RLIMIT_NPROC, nproc);
    if (data) limit(RLIMIT_DATA, data);
    if (fsize) limit(RLIMIT_FSIZE, fsize);
    if (cpus) affinity(cpus);
    if (port && path) {
        if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
            errno = ENAMETOOLONG;
            die(path);
        }
        int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (lfd < 0) die("socket");
        int one = 1;
        setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        struct sockaddr_in sa;
        memset(&sa, 0, sizeof sa);
        sa.sin_family = AF_INET;
        sa.sin_port = htons((unsigned short)atoi(port));
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) < 0) die("bind 127.0.0.1");
        if (listen(lfd, 1024) < 0) die("listen");
        pid_t pid = fork();
        if (pid < 0) die("fork");
        if (pid == 0) {
            signal(SIGPIPE, SIG_IGN);
            int null = open("/dev/null", O_RDWR);
            if (null >= 0) {
                dup2(null, 0);
                dup2(null, 1);
                dup2(null, 2);
                if (null > 2) close(null);
            }
            set_nonblock(lfd);
            serve(lfd, path);
            return 0;
        }
        close(lfd);
    }
    if (launcher > 0) watch(launcher);
    if (fsize) signal(SIGXFSZ, SIG_DFL);
    execvp(argv[optind], argv + optind);
    int err = errno;
    fprintf(stderr, "polar relay: cannot run %s: %s\n", argv[optind], strerror(err));
    return err == ENOENT ? 127 : 126;
}
