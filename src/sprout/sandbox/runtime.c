/* sprout-runtime: run one command inside a running sandbox, confined exactly like `podman exec`.
 *
 * ops/setup_podman.sh compiles this file to runtime/sprout-runtime. Sprout starts it once per command,
 * so it does only the entry: it reads the sandbox's exec profile (written by sprout/sandbox/confinement.py
 * from the container's init process, which runc confined with the spec `podman exec` applies), then
 *   parent: setns(pid) so that the child is born in the container's PID namespace, fork, wait
 *   child:  setsid, join every cgroup of the container (memory/pids limits hold), setns into
 *           ipc/uts/net/mnt, chdir (inside the sandbox), the container's umask and rlimits, drop the
 *           capability bounding set, load the container's own seccomp filters, become the user with the
 *           capability sets podman exec gives it, parent-death signal, no_new_privs, execve with an
 *           explicit environment (the image's, never the caller's).
 * Timeouts, output caps and killing what a command left behind are the caller's (sandbox/execution.py).
 *
 * Exit status: the command's; 128+N when a signal N ended it; 126/127 when it cannot be executed or
 * found; 125 when the runtime itself failed (one line on stderr says why).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define EXIT_RUNTIME_ERROR 125
#define CAP_LAST 40
#define CAP_KNOWN 37 /* caps every kernel we run on knows: failing to drop one is an error */
#define MAX_ITEMS 512

static const char *const NAMESPACES[] = {"ipc", "uts", "net", "mnt"};
#define N_NAMESPACES 4

enum { BND, EFF, PRM, INH, AMB, N_CAPS };

struct rlimit_entry { int resource; struct rlimit limit; };
struct program { struct sock_fprog fprog; };

struct profile {
    long init_pid;
    unsigned long long init_starttime;
    uid_t uid;
    gid_t gid;
    gid_t groups[MAX_ITEMS];
    size_t n_groups;
    unsigned long long caps[N_CAPS];
    int no_new_privs;
    mode_t umask;
    const char *cgroup_procs[MAX_ITEMS];
    size_t n_cgroups;
    struct rlimit_entry rlimits[RLIM_NLIMITS];
    size_t n_rlimits;
    struct program seccomp[MAX_ITEMS];
    size_t n_seccomp;
    char *env[MAX_ITEMS * 2 + 1];
    size_t n_env;
};

static void die(const char *fmt, ...) {
    va_list ap;
    fputs("sprout-runtime: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    _exit(EXIT_RUNTIME_ERROR);
}

static void check(int result, const char *what) {
    if (result != 0)
        die("%s: %s", what, strerror(errno));
}

static const char USAGE[] =
    "usage: sprout-runtime exec --profile FILE [--cwd DIR] [--env K=V]... [--user UID:GID[:GROUPS]]\n"
    "                      -- COMMAND [ARG]...\n\n"
    "Runs COMMAND inside a running Sprout sandbox, confined like `podman exec`: the sandbox's cgroups,\n"
    "namespaces, capability sets, seccomp filter, user and image environment (never this shell's).\n"
    "FILE is the sandbox's exec profile (`sprout sandbox inspect SANDBOX` shows its path).\n"
    "Exit status: the command's; 128+N when signal N ended it; 126/127 when it cannot be executed or\n"
    "found; 125 on a runtime error. Timeouts are the caller's: Sprout kills what a command left behind.\n";

/* A profile value: `\\` and `\n` are escaped (confinement.py writes them), unescaped in place. */
static char *unescape(char *s) {
    char *out = s, *in = s;
    while (*in) {
        if (*in == '\\' && in[1]) {
            *out++ = in[1] == 'n' ? '\n' : in[1];
            in += 2;
        } else {
            *out++ = *in++;
        }
    }
    *out = '\0';
    return s;
}

static unsigned long long number(const char *text, int base, const char *key) {
    char *end;
    errno = 0;
    unsigned long long value = strtoull(text, &end, base);
    if (errno || end == text || (*end && *end != ' '))
        die("exec profile: bad %s value %s", key, text);
    return value;
}

static rlim_t rlimit_value(const char *text) {
    return strncmp(text, "-1", 2) == 0 ? RLIM_INFINITY : (rlim_t)number(text, 10, "rlimit");
}

static int hex_digit(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* A BPF program, hex-encoded: 8 bytes per instruction. */
static void parse_seccomp(struct profile *p, const char *hex) {
    size_t len = strlen(hex);
    if (len == 0 || len % 16 != 0 || p->n_seccomp == MAX_ITEMS)
        die("exec profile: bad seccomp program");
    unsigned char *bytes = malloc(len / 2);
    if (!bytes)
        die("out of memory");
    for (size_t i = 0; i < len / 2; i++) {
        int high = hex_digit(hex[2 * i]), low = hex_digit(hex[2 * i + 1]);
        if (high < 0 || low < 0)
            die("exec profile: bad seccomp program");
        bytes[i] = (unsigned char)(high << 4 | low);
    }
    p->seccomp[p->n_seccomp].fprog.len = (unsigned short)(len / 16);
    p->seccomp[p->n_seccomp++].fprog.filter = (struct sock_filter *)bytes;
}

static void parse_line(struct profile *p, char *key, char *value) {
    if (!strcmp(key, "init_pid")) {
        p->init_pid = (long)number(value, 10, key);
    } else if (!strcmp(key, "init_starttime")) {
        p->init_starttime = number(value, 10, key);
    } else if (!strcmp(key, "uid")) {
        p->uid = (uid_t)number(value, 10, key);
    } else if (!strcmp(key, "gid")) {
        p->gid = (gid_t)number(value, 10, key);
    } else if (!strcmp(key, "groups")) {
        for (char *tok = strtok(value, " "); tok && p->n_groups < MAX_ITEMS; tok = strtok(NULL, " "))
            p->groups[p->n_groups++] = (gid_t)number(tok, 10, key);
    } else if (!strcmp(key, "caps")) {
        char *tok = strtok(value, " ");
        for (int i = 0; i < N_CAPS; i++, tok = strtok(NULL, " ")) {
            if (!tok)
                die("exec profile: caps needs 5 values");
            p->caps[i] = number(tok, 16, key);
        }
    } else if (!strcmp(key, "no_new_privs")) {
        p->no_new_privs = (int)number(value, 10, key);
    } else if (!strcmp(key, "umask")) {
        p->umask = (mode_t)number(value, 10, key);
    } else if (!strcmp(key, "cgroup_procs") && p->n_cgroups < MAX_ITEMS) {
        p->cgroup_procs[p->n_cgroups++] = unescape(value);
    } else if (!strcmp(key, "rlimit") && p->n_rlimits < RLIM_NLIMITS) {
        char *soft = strchr(value, ' '), *hard = soft ? strchr(soft + 1, ' ') : NULL;
        if (!hard)
            die("exec profile: rlimit needs 3 values");
        struct rlimit_entry *r = &p->rlimits[p->n_rlimits++];
        r->resource = (int)number(value, 10, key);
        r->limit.rlim_cur = rlimit_value(soft + 1);
        r->limit.rlim_max = rlimit_value(hard + 1);
    } else if (!strcmp(key, "seccomp")) {
        parse_seccomp(p, value);
    } else if (!strcmp(key, "seccomp_unread") && strcmp(value, "0") != 0) {
        die("the sandbox's seccomp filter could not be read (rootless: that needs CAP_SYS_ADMIN), so its "
            "commands go through `podman exec`");
    } else if (!strcmp(key, "env") && p->n_env < MAX_ITEMS) {
        p->env[p->n_env++] = unescape(value);
    } /* other keys (container_id, freeze_lock) are for Sprout itself */
}

static void read_profile(const char *path, struct profile *p) {
    FILE *f = fopen(path, "r");
    if (!f)
        die("cannot read exec profile %s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int first = 1;
    while ((len = getline(&line, &cap, f)) > 0) {
        if (line[len - 1] == '\n')
            line[--len] = '\0';
        if (first && strcmp(line, "sprout-exec-profile 1") != 0)
            die("%s is not an exec profile this runtime reads (restart the sandbox)", path);
        char *space = strchr(line, ' ');
        if (!first && space) {
            *space = '\0';
            char *value = strdup(space + 1);  /* kept: env and paths point into it */
            if (!value)
                die("out of memory");
            parse_line(p, line, value);
        }
        first = 0;
    }
    free(line);
    fclose(f);
    if (first || !p->init_pid)
        die("exec profile %s is empty or incomplete", path);
}

static unsigned long long proc_starttime(long pid) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    char *field = strrchr(buf, ')');  /* the command name before it may hold spaces */
    if (!field)
        return 0;
    for (int i = 0; i < 20 && field; i++)  /* field 22 (starttime) is the 20th after the name */
        field = strchr(field + 1, ' ');
    return field ? strtoull(field + 1, NULL, 10) : 0;
}

/* The user a command runs as: the profile's, or --user UID:GID[:G1,G2...] with podman exec's capability
 * sets (the container's for root, none for anyone else). */
static void set_user(struct profile *p, const char *spec) {
    char *copy = strdup(spec), *gid, *groups;
    if (!copy || !(gid = strchr(copy, ':')))
        die("--user wants UID:GID[:GROUPS], got %s", spec);
    *gid++ = '\0';
    groups = strchr(gid, ':');
    if (groups)
        *groups++ = '\0';
    p->uid = (uid_t)number(copy, 10, "--user uid");
    p->gid = (gid_t)number(gid, 10, "--user gid");
    p->n_groups = 0;
    for (char *tok = groups ? strtok(groups, ",") : NULL; tok && p->n_groups < MAX_ITEMS; tok = strtok(NULL, ","))
        p->groups[p->n_groups++] = (gid_t)number(tok, 10, "--user groups");
    unsigned long long given = p->uid == 0 ? p->caps[BND] : 0;
    p->caps[EFF] = p->caps[PRM] = given;
    p->caps[INH] = p->caps[AMB] = 0;
}

static void set_env(struct profile *p, char *assignment) {
    char *eq = strchr(assignment, '=');
    if (!eq)
        die("--env wants KEY=VALUE, got %s", assignment);
    size_t key_len = (size_t)(eq - assignment) + 1;
    for (size_t i = 0; i < p->n_env; i++) {
        if (!strncmp(p->env[i], assignment, key_len)) {
            p->env[i] = assignment;
            return;
        }
    }
    if (p->n_env == sizeof p->env / sizeof *p->env - 1)
        die("too many environment variables");
    p->env[p->n_env++] = assignment;
}

static const char *env_get(struct profile *p, const char *key) {
    size_t len = strlen(key);
    for (size_t i = 0; i < p->n_env; i++)
        if (!strncmp(p->env[i], key, len) && p->env[i][len] == '=')
            return p->env[i] + len + 1;
    return NULL;
}

static void capset_all(const unsigned long long *caps) {
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    for (int i = 0; i < 2; i++) {
        data[i].effective = (uint32_t)(caps[EFF] >> (32 * i));
        data[i].permitted = (uint32_t)(caps[PRM] >> (32 * i));
        data[i].inheritable = (uint32_t)(caps[INH] >> (32 * i));
    }
    check((int)syscall(SYS_capset, &header, data), "capset");
}

/* As os.execvpe: PATH is the command's environment's (default /bin:/usr/bin), not this process's. */
static void exec_command(struct profile *p, char **argv) {
    p->env[p->n_env] = NULL;
    int saved = 0;
    if (strchr(argv[0], '/')) {
        execve(argv[0], argv, p->env);
        saved = errno;
    } else {
        const char *path = env_get(p, "PATH");
        char *dirs = strdup(path ? path : "/bin:/usr/bin"), *rest = dirs, *dir, candidate[PATH_MAX];
        while ((dir = strsep(&rest, ":")) != NULL) {
            snprintf(candidate, sizeof candidate, "%s/%s", *dir ? dir : ".", argv[0]);
            execve(candidate, argv, p->env);
            if (errno != ENOENT && errno != ENOTDIR && !saved)
                saved = errno;
        }
        if (!saved)
            saved = ENOENT;
    }
    fprintf(stderr, "sprout-runtime: cannot execute '%s': %s\n", argv[0], strerror(saved));
    _exit(saved == ENOENT ? 127 : 126);
}

/* The parent-death signal is set last (changing credentials clears it), so a parent killed before that
 * would leave the command running: `parent_alive` is the read end of a pipe only the parent writes to,
 * and it reads as hung up once the parent is gone. */
static void die_with_parent(int parent_alive) {
    check(prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "parent-death signal");
    struct pollfd gone = {.fd = parent_alive, .events = POLLIN};
    if (poll(&gone, 1, 0) != 0)
        _exit(128 + SIGKILL);
}

static void enter_and_exec(struct profile *p, const int *ns_fds, int parent_alive, const char *cwd,
                           char **argv) {
    setsid();
    for (size_t i = 0; i < p->n_cgroups; i++) {
        int fd = open(p->cgroup_procs[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1)
            die("cannot join cgroup %s: %s", p->cgroup_procs[i], strerror(errno));
        close(fd);
    }
    for (int i = 0; i < N_NAMESPACES; i++)
        if (setns(ns_fds[i], 0) != 0)
            die("setns(%s): %s", NAMESPACES[i], strerror(errno));
    if (chdir(cwd) != 0)
        die("cannot change directory to '%s' inside the sandbox: %s", cwd, strerror(errno));
    umask(p->umask);
    for (size_t i = 0; i < p->n_rlimits; i++)
        check(setrlimit(p->rlimits[i].resource, &p->rlimits[i].limit), "setrlimit");
    for (int cap = 0; cap <= CAP_LAST; cap++)
        if (!(p->caps[BND] >> cap & 1) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && cap <= CAP_KNOWN)
            die("cannot drop capability %d: %s", cap, strerror(errno));
    for (size_t i = 0; i < p->n_seccomp; i++)
        check(prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &p->seccomp[i].fprog, 0, 0), "seccomp");
    check(setgroups(p->n_groups, p->groups), "setgroups");
    check(setresgid(p->gid, p->gid, p->gid), "setresgid");
    check(setresuid(p->uid, p->uid, p->uid), "setresuid");
    capset_all(p->caps);
    for (int cap = 0; cap <= CAP_LAST; cap++)
        if (p->caps[AMB] >> cap & 1)
            check(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0), "ambient capability");
    die_with_parent(parent_alive);
    if (p->no_new_privs)
        check(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs");
    exec_command(p, argv);
}

static int run(struct profile *p, const char *cwd, char **argv) {
    char path[64];
    int ns_fds[N_NAMESPACES], pid_ns, parent_alive[2];
    if (proc_starttime(p->init_pid) != p->init_starttime)
        die("sandbox is not running (its init process is gone)");
    for (int i = 0; i < N_NAMESPACES; i++) {
        snprintf(path, sizeof path, "/proc/%ld/ns/%s", p->init_pid, NAMESPACES[i]);
        if ((ns_fds[i] = open(path, O_RDONLY | O_CLOEXEC)) < 0)
            die("sandbox is not running (its init process is gone)");
    }
    snprintf(path, sizeof path, "/proc/%ld/ns/pid", p->init_pid);
    if ((pid_ns = open(path, O_RDONLY | O_CLOEXEC)) < 0 || setns(pid_ns, CLONE_NEWPID) != 0)
        die("cannot enter the sandbox's PID namespace: %s", strerror(errno));
    if (pipe2(parent_alive, O_CLOEXEC) != 0)
        die("pipe: %s", strerror(errno));
    pid_t child = fork();
    if (child < 0)
        die("fork: %s", strerror(errno));
    if (child == 0) {
        close(parent_alive[1]);
        enter_and_exec(p, ns_fds, parent_alive[0], cwd, argv);
    }
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR)
            die("waitpid: %s", strerror(errno));
    return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

int main(int argc, char **argv) {
    static struct profile p;
    const char *profile_path = NULL, *cwd = "/", *user = NULL;
    char *env[MAX_ITEMS];
    size_t n_env = 0;
    int i = 2;
    if (argc > 1 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
        fputs(USAGE, stdout);
        return 0;
    }
    if (argc < 2 || strcmp(argv[1], "exec") != 0) {
        fprintf(stderr, "sprout-runtime: %s", USAGE);
        return EXIT_RUNTIME_ERROR;
    }
    for (; i < argc && strcmp(argv[i], "--") != 0; i += 2) {
        const char *flag = argv[i];
        if (!strcmp(flag, "-h") || !strcmp(flag, "--help")) {
            fputs(USAGE, stdout);
            return 0;
        }
        if (i + 1 >= argc)
            die("%s needs a value", flag);
        if (!strcmp(flag, "--profile"))
            profile_path = argv[i + 1];
        else if (!strcmp(flag, "--cwd"))
            cwd = argv[i + 1];
        else if (!strcmp(flag, "--user"))
            user = argv[i + 1];
        else if (!strcmp(flag, "--env") && n_env < MAX_ITEMS)
            env[n_env++] = argv[i + 1];
        else if (!strcmp(flag, "--env"))
            die("too many --env options");
        else
            die("unknown option %s (see sprout-runtime --help)", flag);
    }
    if (i + 1 >= argc || !profile_path) {
        fprintf(stderr, "sprout-runtime: %s", USAGE);
        return EXIT_RUNTIME_ERROR;
    }
    read_profile(profile_path, &p);
    if (user)
        set_user(&p, user);
    for (size_t k = 0; k < n_env; k++)
        set_env(&p, env[k]);
    return run(&p, cwd, argv + i + 1);
}
