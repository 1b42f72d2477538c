/* sprout-agent: the guest side of Sprout's microVM backend.
 *
 * Runs as the guest's PID 1 after the initramfs has mounted the sandbox's disk at ROOT. It opens the
 * virtio-serial port named "sprout.agent", enters ROOT (chroot) and serves one request at a time.
 * Frames, both ways: 4-byte big-endian length, 1 type byte, payload.
 *
 *   host -> guest  'P' ping with a token            -> 'k' with the same token
 *                  'R' run: NUL-separated fields     -> 'o' output chunks..., then 'x' "<code> <timed_out>"
 *                      cwd, user, timeout_ms, env count, env "K=V"..., argv...; a 'C' sent while it
 *                      runs cancels it (its processes are killed as on timeout), and so does its host
 *                      hanging up or another client's request (served after it)
 *                  'S' sync the filesystems         -> 'k'
 *                  'F' freeze the root filesystem   -> 'k'   (sync + FIFREEZE: the disk is consistent)
 *                  'T' thaw it                      -> 'k'
 *                  'I' identity: hostname, machine id, entropy bytes -> 'k'
 *                  'M' make dirs: path, mode, uid, gid   -> 'k'  (mkdir -p; new dirs get the owner and
 *                      mode, the last one the mode too; mode "" leaves modes as they are)
 *                  'W' write: kind, path, mode, uid, gid, data -> 'k'  (kind f: a regular file, links
 *                      followed; n: the same, refusing a link there; a: append to it; l: a symlink to
 *                      data, replacing a link or file; parents must exist)
 *                  'G' get: path, max bytes          -> 'd' data chunks..., then 'k'; 'n' when absent
 *                  'L' list: path, recursive "0"/"1" -> 'l' records..., then 'k'; 'n' when absent. A
 *                      record is a kind (f regular file, d directory, o anything else) and a path relative
 *                      to `path` ("." for itself), NUL-terminated; links are followed, but a link to a
 *                      directory is 'o' and never entered.
 *                  'N' inventory: path               -> 'l' records..., then 'k'; 'n' when absent. Every entry
 *                      under `path` on its filesystem, links not followed, as "<st_mode octal> <uid> <gid>
 *                      <size> <mtime ns> <ctime ns> <inode>" NUL, its path relative to `path` ("." for
 *                      itself) NUL, a link's target (else nothing) NUL.
 *   guest -> host  '!' "<message>" when a request cannot be served.
 *
 * A command runs in its own session with stdout and stderr merged on one pipe and stdin /dev/null.
 * On timeout every process that started while it ran is killed (its process group, and what left it
 * with setsid or a double fork); processes that ran before it are left alone. Processes it leaves in
 * the background keep running (a server started in one turn answers in the next); as PID 1 the agent
 * reaps what they orphan.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <dirent.h>
#include <ftw.h>
#include <glob.h>
#include <grp.h>
#include <limits.h>
#include <linux/fs.h>
#include <linux/random.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_FRAME (16 << 20)
#define MAX_PROCS 8192
#define EXIT_GRACE_MS 100

static int port = -1;
static sigset_t sigio;  /* blocked in the agent; the port raises it when the host connects */
static pid_t running = 0;
static int running_status = -1;

static void die(const char *what) {
    fprintf(stderr, "sprout-agent: %s: %s\n", what, strerror(errno));
    sleep(1);
    exit(1);
}

static int write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n, len -= (size_t)n;
    }
    return 0;
}

static void send_frame(char type, const void *payload, uint32_t len) {
    unsigned char head[5] = {len >> 24, len >> 16, len >> 8, len, (unsigned char)type};
    if (write_all(port, head, 5) < 0 || write_all(port, payload, len) < 0)
        fprintf(stderr, "sprout-agent: lost a frame to the host: %s\n", strerror(errno));
}

static void send_text(char type, const char *text) { send_frame(type, text, (uint32_t)strlen(text)); }

/* Reads exactly len bytes of a frame. While no host is connected the port reads as end-of-file; the
 * agent then sleeps until the port signals a connection (SIGIO), or a second passes. A host that
 * hangs up in the middle of a frame (`started`, or once a byte of it came) abandons it: -1. */
static int read_full(void *buf, size_t len, int started) {
    char *p = buf;
    struct timespec second = {1, 0};
    while (len > 0) {
        ssize_t n = read(port, p, len);
        if (n > 0) { p += n, len -= (size_t)n, started = 1; continue; }
        if (n < 0 && errno != EINTR && errno != EAGAIN) die("read from the host");
        if (n == 0 && started) return -1;
        sigtimedwait(&sigio, NULL, &second);
    }
    return 0;
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
        if (pid == running) running_status = status;
}

typedef struct { int pid; unsigned long long start; } proc_id;

/* Whether a process that reads as a zombie still has a thread running: its main thread exited
 * (pthread_exit, SYS_exit) and the others run on. */
static int has_live_threads(int pid) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task", pid);
    DIR *tasks = opendir(path);
    struct dirent *entry;
    int count = 0;
    while (tasks && (entry = readdir(tasks))) count += entry->d_name[0] != '.';
    if (tasks) closedir(tasks);
    return count > 1;
}

/* The guest's processes but the agent, kernel threads and zombies, as (pid, start time). */
static int list_procs(proc_id *out) {
    int count = 0;
    DIR *proc = opendir("/proc");
    struct dirent *entry;
    while (proc && count < MAX_PROCS && (entry = readdir(proc))) {
        int pid = atoi(entry->d_name);
        if (pid <= 2) continue;
        char path[64], stat[1024];
        snprintf(path, sizeof path, "/proc/%d/stat", pid);
        int fd = open(path, O_RDONLY);
        if (fd < 0) continue;
        ssize_t n = read(fd, stat, sizeof stat - 1);
        close(fd);
        char *rest = n > 0 ? (stat[n] = '\0', strrchr(stat, ')')) : NULL;
        char state;
        int ppid;
        unsigned long long start;
        if (!rest || sscanf(rest + 2, "%c %d %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %*s %llu",
                            &state, &ppid, &start) != 3) continue;
        if ((state == 'Z' && !has_live_threads(pid)) || ppid == 2) continue;
        out[count++] = (proc_id){pid, start};
    }
    if (proc) closedir(proc);
    return count;
}

/* Kills, until none is left, every process not in `before` (what a command started, wherever it went). */
static void kill_new(const proc_id *before, int before_count) {
    static proc_id now[MAX_PROCS];
    for (int round = 0; round < 100; round++) {
        int count = list_procs(now), killed = 0;
        for (int i = 0; i < count; i++) {
            int known = 0;
            for (int j = 0; j < before_count && !known; j++)
                known = before[j].pid == now[i].pid && before[j].start == now[i].start;
            if (!known) killed += kill(now[i].pid, SIGKILL) == 0;
        }
        reap();
        if (!killed) return;
        usleep(2000);
    }
}

/* A regular file of the sandbox's, opened without blocking: a FIFO or a device must not block PID 1. */
static FILE *open_regular(const char *path) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) || !S_ISREG(st.st_mode))) { close(fd); fd = -1; }
    return fd >= 0 ? fdopen(fd, "r") : NULL;
}

/* Finds the line of /etc/passwd or /etc/group whose name is `name`, or (name NULL) whose id field
 * (field 2) is `id`; splits it at ':' into `fields` (empty fields kept). Returns 0 when found. */
static int lookup(const char *path, const char *name, unsigned long id, char *line, size_t size,
                  char **fields, int nfields) {
    FILE *f = open_regular(path);
    while (f && fgets(line, (int)size, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *rest = line;
        int n = 0;
        while (n < nfields && rest) fields[n++] = strsep(&rest, ":");
        if (n < 3) continue;
        if (name ? !strcmp(fields[0], name) : strtoul(fields[2], NULL, 10) == id) { fclose(f); return 0; }
    }
    if (f) fclose(f);
    return -1;
}

static int numeric(const char *text, unsigned long *value) {
    char *end;
    *value = strtoul(text, &end, 10);
    return *text && !*end;
}

typedef struct { uid_t uid; gid_t gid; gid_t groups[64]; int ngroups; } identity_t;

/* "user[:group]", each a name or a number, as the container backend (sprout/sandbox/users.py) takes
 * it: names are looked up in the sandbox's /etc/passwd and /etc/group; the user's groups there are its
 * supplementary groups; a number without an entry has the group of the same number. */
static int resolve_user(char *spec, identity_t *who) {
    char line[4096], *fields[7], *group = strchr(spec, ':'), name[256] = "";
    unsigned long n;
    if (group) *group++ = '\0';
    if (numeric(spec, &n)) {
        who->uid = (uid_t)n, who->gid = (gid_t)n;  /* no entry: the group of the same number */
        if (!lookup("/etc/passwd", NULL, n, line, sizeof line, fields, 7) && fields[3])
            who->gid = (gid_t)strtoul(fields[3], NULL, 10), snprintf(name, sizeof name, "%s", fields[0]);
    } else if (!lookup("/etc/passwd", spec, 0, line, sizeof line, fields, 7) && fields[3]) {
        who->uid = (uid_t)strtoul(fields[2], NULL, 10), who->gid = (gid_t)strtoul(fields[3], NULL, 10);
        snprintf(name, sizeof name, "%s", spec);
    } else if (!strcmp(spec, "root")) {
        who->uid = 0, who->gid = 0;
    } else {
        return -1;
    }
    if (group && numeric(group, &n)) who->gid = (gid_t)n;
    else if (group && !lookup("/etc/group", group, 0, line, sizeof line, fields, 4)) who->gid = (gid_t)strtoul(fields[2], NULL, 10);
    else if (group) return -1;
    who->groups[0] = who->gid, who->ngroups = 1;
    FILE *f = *name ? open_regular("/etc/group") : NULL;
    while (f && who->ngroups < 64 && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *rest = line, *part[4] = {0};
        for (int i = 0; i < 4 && rest; i++) part[i] = strsep(&rest, ":");
        for (char *member; part[3] && (member = strsep(&part[3], ","));)
            if (!strcmp(member, name)) { who->groups[who->ngroups++] = (gid_t)strtoul(part[2], NULL, 10); break; }
    }
    if (f) fclose(f);
    return 0;
}

static void child(int out, char *cwd, const identity_t *who, char **env, char **argv) {
    setsid();
    sigprocmask(SIG_UNBLOCK, &sigio, NULL);
    int devnull = open("/dev/null", O_RDONLY);
    dup2(devnull, 0), dup2(out, 1), dup2(out, 2);
    if (devnull > 2) close(devnull);
    signal(SIGPIPE, SIG_DFL);
    if (setgroups((size_t)who->ngroups, who->groups) || setgid(who->gid) || setuid(who->uid)) {
        dprintf(2, "sprout-agent: cannot become %u:%u: %s\n", who->uid, who->gid, strerror(errno));
        _exit(126);
    }
    if (chdir(cwd)) {
        dprintf(2, "sprout-agent: cannot enter %s: %s\n", cwd, strerror(errno));
        _exit(126);
    }
    environ = env;
    execvp(argv[0], argv);
    dprintf(2, "sprout-agent: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
}

/* A request that came while a command ran and was not a cancel: served after the command (a new
 * client's ping, when the one that started the command died). */
static unsigned char pending_head[5];
static char *pending_payload;

enum { FRAME_OK, FRAME_TOO_LARGE, FRAME_ABANDONED };

/* Reads one frame's payload (the length from its header) into a new buffer; NULL when it is too large
 * (read away) or its host hung up before the end, as *status says. */
static char *read_payload(const unsigned char *head, int *status) {
    uint32_t len = (uint32_t)head[0] << 24 | head[1] << 16 | head[2] << 8 | head[3];
    char *payload = malloc(len > MAX_FRAME ? 65536 : len + 1);
    if (!payload) die("out of memory");
    *status = FRAME_OK;
    if (len > MAX_FRAME) {  /* the host never sends these: read it away and refuse it */
        for (uint32_t left = len; left && *status == FRAME_OK; left -= left < 65536 ? left : 65536)
            if (read_full(payload, left < 65536 ? left : 65536, 1)) *status = FRAME_ABANDONED;
        if (*status == FRAME_OK) *status = FRAME_TOO_LARGE;
    } else if (read_full(payload, len, 1)) {
        *status = FRAME_ABANDONED;
    }
    if (*status != FRAME_OK) { free(payload); return NULL; }
    payload[len] = '\0';
    return payload;
}

/* Whether the command is to be cut short: the host sent 'C' (cancel) or hung up. Requests are served
 * one client at a time, so any other request means a new client, and the one that started the
 * command is gone: that request is kept for after the command, which is cancelled (a dead client's
 * command must not hold the agent). */
static int cancelled(const struct pollfd *host) {
    if (host->revents & (POLLHUP | POLLERR) && !(host->revents & POLLIN)) return 1;
    if (!(host->revents & POLLIN)) return 0;
    ssize_t n = read(port, pending_head, 5);
    int status;
    if (n <= 0 || (n < 5 && read_full(pending_head + n, (size_t)(5 - n), 1))) return 1;
    char *payload = read_payload(pending_head, &status);
    if (pending_head[4] != 'C' && status == FRAME_OK) pending_payload = payload;
    else free(payload);
    return 1;
}

/* Streams the command's output until it exits (plus a short grace for buffered output: a background
 * job may hold the pipe open forever), its deadline passes or the host cancels it; returns whether
 * it was cut short. */
static int stream(int out, long long deadline) {
    char buf[65536];
    long long exited_at = -1;
    struct pollfd p[2] = {{out, POLLIN, 0}, {port, POLLIN, 0}};
    for (;;) {
        long long now = now_ms();
        reap();
        if (running_status >= 0 && exited_at < 0) exited_at = now;
        if (exited_at >= 0 && (p[0].fd < 0 || now - exited_at > EXIT_GRACE_MS)) return 0;
        if (deadline > 0 && now >= deadline) return 1;
        if (poll(p, 2, p[0].fd < 0 ? 5 : 20) <= 0) continue;
        if (p[1].fd >= 0 && cancelled(&p[1])) return 1;
        if (!(p[0].revents & (POLLIN | POLLHUP))) continue;
        ssize_t n = read(out, buf, sizeof buf);
        if (n > 0) send_frame('o', buf, (uint32_t)n);
        else if (n == 0) p[0].fd = -1;  /* all output read: wait for the exit (or the deadline, a cancel) */
    }
}

static void run(char *payload, uint32_t len) {
    char *fields[4096];
    int count = 0;
    char *p = payload;
    for (; p < payload + len && count < 4095; p += strlen(p) + 1) fields[count++] = p;
    fields[count] = NULL;
    int envc = count >= 4 ? atoi(fields[3]) : -1;
    if (p < payload + len || envc < 0 || 4 + envc >= count) { send_text('!', "malformed run request"); return; }
    identity_t who;
    char user[256];
    snprintf(user, sizeof user, "%s", fields[1]);
    if (resolve_user(user, &who)) {
        char msg[300];
        snprintf(msg, sizeof msg, "unknown user %.200s in this sandbox", fields[1]);
        send_text('!', msg);
        return;
    }
    char **env = calloc((size_t)envc + 1, sizeof *env);
    if (!env) { send_text('!', "out of memory"); return; }
    memcpy(env, fields + 4, (size_t)envc * sizeof *env);
    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC)) { send_text('!', "pipe failed"); free(env); return; }
    long long timeout = atoll(fields[2]), deadline = timeout > 0 ? now_ms() + timeout : 0;
    static proc_id before[MAX_PROCS];
    int before_count = list_procs(before);
    running_status = -1;
    running = fork();
    if (running == 0) child(pipefd[1], fields[0], &who, env, fields + 4 + envc);
    close(pipefd[1]);
    free(env);
    if (running < 0) {
        running = 0;
        close(pipefd[0]);
        send_text('!', "fork failed");
        return;
    }
    int timed_out = stream(pipefd[0], deadline);
    if (timed_out || running_status < 0) {
        kill(-running, SIGKILL);
        kill_new(before, before_count);
    }
    while (running_status < 0) { usleep(2000); reap(); }
    close(pipefd[0]);
    int st = running_status, code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    char result[64];
    snprintf(result, sizeof result, "%d %d", code, timed_out);
    running = 0;
    send_text('x', result);
}

static void freeze(unsigned long request) {
    sync();
    int fd = open("/", O_RDONLY | O_DIRECTORY);
    int ok = fd >= 0 && ioctl(fd, request, 0) == 0;
    if (fd >= 0) close(fd);
    /* thawing a filesystem that is not frozen fails with EINVAL: that is the state asked for */
    if (ok || (request == FITHAW && errno == EINVAL)) send_text('k', "");
    else send_text('!', request == FIFREEZE ? "freeze failed" : "thaw failed");
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0444);
    if (fd >= 0) { write_all(fd, text, strlen(text)); write_all(fd, "\n", 1); close(fd); }
}

/* A branch of a memory image must not share its parent's identity or random state. */
static void identity(char *payload, uint32_t len) {
    char *end = payload + len, *hostname = payload, *machine_id = memchr(hostname, '\0', len), *seed = NULL;
    if (machine_id) machine_id++, seed = memchr(machine_id, '\0', (size_t)(end - machine_id));
    if (!seed++) { send_text('!', "malformed identity request"); return; }
    int seed_len = (int)(end - seed);
    sethostname(hostname, strlen(hostname));
    write_file("/etc/hostname", hostname);
    write_file("/etc/machine-id", machine_id);
    struct { struct rand_pool_info info; char bytes[256]; } pool;
    pool.info.entropy_count = 8 * (seed_len > 256 ? 256 : seed_len);
    pool.info.buf_size = pool.info.entropy_count / 8;
    memcpy(pool.bytes, seed, (size_t)pool.info.buf_size);
    int fd = open("/dev/urandom", O_WRONLY);
    /* the credited bytes wait in the input pool until the next scheduled reseed (up to a minute
     * away): reseed now, or the branch's random numbers go on repeating its siblings' */
    int ok = fd >= 0 && ioctl(fd, RNDADDENTROPY, &pool) == 0 && ioctl(fd, RNDRESEEDCRNG) == 0;
    if (fd >= 0) close(fd);
    if (ok) send_text('k', "");
    else send_text('!', "reseeding the random pool failed");
}

/* ---------------------------------------------------------------- files
 * The host's transfers (Harbor's uploads and downloads, grading) work through these: the guest
 * resolves paths in its own root, so nothing it holds can point the host elsewhere. Files are opened
 * without blocking: a FIFO where a file is expected must not block PID 1. */

/* Splits a request into `want` NUL-terminated fields and the rest (data), or fails. */
static int split(char *payload, uint32_t len, char **fields, int want, char **rest, uint32_t *rest_len) {
    char *p = payload, *end = payload + len;
    for (int i = 0; i < want; i++) {
        char *nul = memchr(p, '\0', (size_t)(end - p));
        if (!nul) return -1;
        fields[i] = p, p = nul + 1;
    }
    if (rest) *rest = p, *rest_len = (uint32_t)(end - p);
    return 0;
}

static void refuse(const char *what, const char *path) {
    char msg[600];
    snprintf(msg, sizeof msg, "%s %.400s: %s", what, path, strerror(errno));
    send_text('!', msg);
}

static void not_regular(const char *path) {
    char msg[600];
    snprintf(msg, sizeof msg, "%.400s in the sandbox is not a regular file", path);
    send_text('!', msg);
}

/* mkdir -p `path`; directories it makes belong to uid:gid with `mode` (0755 when mode < 0). */
static int make_dirs(char *path, long mode, uid_t uid, gid_t gid) {
    for (char *slash = path; slash; ) {
        slash = strchr(slash + 1, '/');
        if (slash) *slash = '\0';
        struct stat st;
        if (*path && mkdir(path, 0755) == 0) {
            if (chown(path, uid, gid) || (mode >= 0 && chmod(path, (mode_t)mode))) return -1;
        } else if (*path) {
            int failed = errno;  /* EEXIST: fine if it is a directory (or a link to one) */
            if (stat(path, &st) || !S_ISDIR(st.st_mode)) {
                errno = failed == EEXIST ? ENOTDIR : failed;
                return -1;
            }
        }
        if (slash) *slash = '/';
    }
    return mode >= 0 ? chmod(path, (mode_t)mode) : 0;
}

static void make_dirs_request(char *payload, uint32_t len) {
    char *f[4];
    if (split(payload, len, f, 4, NULL, NULL) || f[0][0] != '/') { send_text('!', "malformed make-dirs request"); return; }
    errno = 0;
    if (make_dirs(f[0], *f[1] ? strtol(f[1], NULL, 8) : -1, (uid_t)atol(f[2]), (gid_t)atol(f[3])))
        refuse("cannot make the directory", f[0]);
    else send_text('k', "");
}

static void write_request(char *payload, uint32_t len) {
    char *f[5], *data;
    uint32_t size;
    if (split(payload, len, f, 5, &data, &size) || f[1][0] != '/') { send_text('!', "malformed write request"); return; }
    const char *path = f[1];
    uid_t uid = (uid_t)atol(f[3]);
    gid_t gid = (gid_t)atol(f[4]);
    if (f[0][0] == 'l') {
        struct stat st;
        if (lstat(path, &st) == 0) {
            if (S_ISDIR(st.st_mode)) errno = EISDIR;
            if (S_ISDIR(st.st_mode) || unlink(path)) { refuse("cannot replace", path); return; }
        }
        if (symlink(data, path) || lchown(path, uid, gid)) refuse("cannot make the link", path);
        else send_text('k', "");
        return;
    }
    int append = f[0][0] == 'a', follow = f[0][0] != 'n';
    int fd = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC | (append ? O_APPEND : O_CREAT) | (follow ? 0 : O_NOFOLLOW), 0600);
    struct stat st;
    if (fd < 0) { refuse("cannot write", path); return; }
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) { close(fd); not_regular(path); return; }
    int ok = (append || ftruncate(fd, 0) == 0) && write_all(fd, data, size) == 0
             && (append || (fchmod(fd, (mode_t)strtol(f[2], NULL, 8)) == 0 && fchown(fd, uid, gid) == 0));
    close(fd);
    if (ok) send_text('k', "");
    else refuse("cannot write", path);
}

static void get_request(char *payload, uint32_t len) {
    char *f[2];
    if (split(payload, len, f, 2, NULL, NULL)) { send_text('!', "malformed get request"); return; }
    long long max = atoll(f[1]), sent = 0;
    int fd = open(f[0], O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    struct stat st;
    if (fd < 0 && (errno == ENOENT || errno == ENOTDIR)) { send_text('n', ""); return; }
    if (fd < 0) { refuse("cannot read", f[0]); return; }
    char msg[600];
    snprintf(msg, sizeof msg, "%.400s in the sandbox is larger than %lld bytes", f[0], max);
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) { close(fd); not_regular(f[0]); return; }
    if (st.st_size > max) { close(fd); send_text('!', msg); return; }
    char buf[65536];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0 && (sent += n) <= max) send_frame('d', buf, (uint32_t)n);
    close(fd);
    if (n < 0) refuse("cannot read", f[0]);
    else if (sent > max) send_text('!', msg);
    else send_text('k', "");
}

static char records[65536];
static size_t records_len, list_root_len;

static void append_record(const char *data, size_t size) {
    if (records_len + size > sizeof records) { send_frame('l', records, (uint32_t)records_len); records_len = 0; }
    if (size > sizeof records) return;
    memcpy(records + records_len, data, size);
    records_len += size;
}

static void record(char kind, const char *relative) {
    char data[PATH_MAX + 2];
    int size = snprintf(data, sizeof data, "%c%s", kind, relative);
    if (size > 0 && (size_t)size < sizeof data) append_record(data, (size_t)size + 1);
}

static char kind_of(const char *path, const struct stat *lst) {
    struct stat st;
    if (!S_ISLNK(lst->st_mode)) return S_ISREG(lst->st_mode) ? 'f' : S_ISDIR(lst->st_mode) ? 'd' : 'o';
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) ? 'f' : 'o';
}

static int list_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    if (ftw->level > 0 && flag != FTW_NS) record(kind_of(path, st), path + list_root_len + 1);
    return 0;  /* FTW_NS: gone meanwhile, or unreadable: not listed */
}

static void list_request(char *payload, uint32_t len) {
    char *f[2];
    if (split(payload, len, f, 2, NULL, NULL)) { send_text('!', "malformed list request"); return; }
    struct stat st;
    if (stat(f[0], &st)) {
        if (errno == ENOENT || errno == ENOTDIR) send_text('n', "");
        else refuse("cannot list", f[0]);
        return;
    }
    records_len = 0;
    char kind = S_ISREG(st.st_mode) ? 'f' : S_ISDIR(st.st_mode) ? 'd' : 'o';
    record(kind, ".");
    char root[PATH_MAX];
    if (kind == 'd' && f[1][0] == '1' && realpath(f[0], root)) {  /* a link to a directory is walked too */
        list_root_len = strcmp(root, "/") ? strlen(root) : 0;
        nftw(root, list_entry, 32, FTW_PHYS);
    }
    send_frame('l', records, (uint32_t)records_len);
    send_text('k', "");
}

static dev_t inventory_dev;

static int inventory_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    if (flag == FTW_NS || st->st_dev != inventory_dev) return 0;  /* gone meanwhile, or another filesystem */
    char data[2 * PATH_MAX + 128], target[PATH_MAX] = "";
    if (S_ISLNK(st->st_mode)) {
        ssize_t n = readlink(path, target, sizeof target - 1);
        target[n > 0 ? n : 0] = '\0';
    }
    const char *relative = ftw->level > 0 ? path + list_root_len + 1 : ".";
    int head = snprintf(data, sizeof data, "%o %u %u %lld %lld %lld %llu", (unsigned)st->st_mode, (unsigned)st->st_uid,
                        (unsigned)st->st_gid, (long long)st->st_size,
                        (long long)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec,
                        (long long)st->st_ctim.tv_sec * 1000000000LL + st->st_ctim.tv_nsec,
                        (unsigned long long)st->st_ino);
    int size = snprintf(data + head + 1, sizeof data - (size_t)head - 1, "%s%c%s", relative, '\0', target);
    if (head > 0 && size > 0 && (size_t)(head + 1 + size + 1) <= sizeof data) append_record(data, (size_t)(head + size + 2));
    return 0;
}

static void inventory_request(char *payload, uint32_t len) {
    char *f[1];
    if (split(payload, len, f, 1, NULL, NULL)) { send_text('!', "malformed inventory request"); return; }
    struct stat st;
    if (lstat(f[0], &st)) {
        if (errno == ENOENT || errno == ENOTDIR) send_text('n', "");
        else refuse("cannot list", f[0]);
        return;
    }
    records_len = 0;
    inventory_dev = st.st_dev;
    list_root_len = strcmp(f[0], "/") ? strlen(f[0]) : 0;
    nftw(f[0], inventory_entry, 32, FTW_PHYS | FTW_MOUNT);
    send_frame('l', records, (uint32_t)records_len);
    send_text('k', "");
}

static void open_port(void) {
    glob_t names;
    if (glob("/sys/class/virtio-ports/*/name", 0, NULL, &names)) die("no virtio-serial ports");
    for (size_t i = 0; i < names.gl_pathc && port < 0; i++) {
        char name[64] = {0}, dev[128];
        FILE *f = fopen(names.gl_pathv[i], "r");
        if (!f) continue;
        if (fgets(name, sizeof name, f) && !strncmp(name, "sprout.agent", 12)) {
            const char *dir = names.gl_pathv[i] + strlen("/sys/class/virtio-ports/");
            snprintf(dev, sizeof dev, "/dev/%.*s", (int)(strchr(dir, '/') - dir), dir);
            port = open(dev, O_RDWR | O_CLOEXEC);
        }
        fclose(f);
    }
    globfree(&names);
    if (port < 0) die("cannot open the sprout.agent port");
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: sprout-agent ROOT\n"); return 2; }
    signal(SIGPIPE, SIG_IGN);
    open_port();
    sigemptyset(&sigio);
    sigaddset(&sigio, SIGIO);
    sigprocmask(SIG_BLOCK, &sigio, NULL);
    if (fcntl(port, F_SETOWN, getpid()) || fcntl(port, F_SETFL, fcntl(port, F_GETFL) | O_ASYNC))
        die("cannot have the port signal the host's connections");
    if (chroot(argv[1]) || chdir("/")) die("cannot enter the sandbox's root");
    for (;;) {
        unsigned char head[5];
        char *payload;
        int status = FRAME_OK;
        uint32_t len;
        if (pending_payload) {
            memcpy(head, pending_head, 5);
            payload = pending_payload, pending_payload = NULL;
        } else {
            if (read_full(head, 5, 0)) continue;
            payload = read_payload(head, &status);
        }
        if (status == FRAME_TOO_LARGE) send_text('!', "request too large");
        if (!payload) continue;
        len = (uint32_t)head[0] << 24 | head[1] << 16 | head[2] << 8 | head[3];
        switch (head[4]) {
            case 'P': send_frame('k', payload, len); break;
            case 'C': break;  /* a cancel that came after its command ended: nothing to do */
            case 'R': run(payload, len); break;
            case 'S': sync(); send_text('k', ""); break;
            case 'F': freeze(FIFREEZE); break;
            case 'T': freeze(FITHAW); break;
            case 'I': identity(payload, len); break;
            case 'M': make_dirs_request(payload, len); break;
            case 'W': write_request(payload, len); break;
            case 'G': get_request(payload, len); break;
            case 'L': list_request(payload, len); break;
            case 'N': inventory_request(payload, len); break;
            default: send_text('!', "unknown request");
        }
        free(payload);
        reap();
    }
}
