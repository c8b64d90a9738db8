
/*
 * Copyright (C) resty-loom authors
 *
 * loom_java: an offload runtime (include/loom_offload.h) that runs Java
 * handlers (loom.offload.Handler) on threads of an embedded JVM.
 *
 * Configuration string given to offload.load(): key=value pairs separated
 * by white space:
 *
 *     classpath=<a>[:<b>]   where the handler classes are (jars or class
 *                           directories); each load has its own class
 *                           loader
 *     xmx=<size>            the JVM's heap cap, -Xmx (default 64m)
 *     cpus=<n>              -XX:ActiveProcessorCount (default 1): the
 *                           JVM sizes its GC and compiler threads from it
 *     jvm_options=<o>[,<o>] more JVM options (e.g. -Xcheck:jni)
 *     java_home=<dir>       the JDK or JRE (default: the one the runtime
 *                           was built with)
 *
 * Any other word fails the load (see ../common/loom_rt_config.h).
 *
 * One JVM per worker process (a process can hold only one): the first
 * load in a worker creates it, on the host's start-up thread, after fork
 * (never in the master), with -Xrs so that nginx keeps HUP, QUIT, TERM,
 * INT and USR1, and with the heap and CPU caps above. A later load whose
 * xmx/cpus/jvm_options/java_home differ fails. A JVM that cannot start
 * fails the load with its own message in the error log; one that exits
 * the process while starting (a heap it cannot reserve, for one) is not
 * tried again after LOOM_JAVA_MAX_ATTEMPTS such exits under the same
 * master and options, so a bad option cannot make the workers crash-loop.
 *
 * Calls run on Java threads the runtime starts (the nginx thread never
 * enters Java): each takes a task through the native methods registered
 * below, finds the handler by class name, and answers.
 */


#define _GNU_SOURCE
#define LOOM_OFFLOAD_NO_PROTOTYPES
#include <loom_offload.h>
#include "../common/loom_rt_config.h"

#include <jni.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>


#ifndef LOOM_JAVA_HOME
#define LOOM_JAVA_HOME  "/usr/lib/jvm/java-17-openjdk-amd64"
#endif

#define LOOM_JAVA_JAR           "loom-offload.jar"
#define LOOM_JAVA_MAX_OPTIONS   32
#define LOOM_JAVA_MAX_ATTEMPTS  3

/* handler names up to this long are remembered, see loom_java_next */
#define LOOM_JAVA_NAME_CACHE    256


typedef jint (JNICALL *loom_java_create_pt)(JavaVM **vm, void **env,
    void *args);


typedef struct {
    const loom_offload_host_t  *host;
    loom_offload_queue_t       *queue;
    jobject                     runtime;
    pthread_mutex_t             lock;
    pthread_cond_t              cond;
    unsigned int                live;
} loom_java_rt_t;


__attribute__((visibility("default")))
int loom_offload_init(loom_offload_init_t *init);
__attribute__((visibility("default")))
void loom_offload_shutdown(void *instance);

static int loom_java_start_vm(loom_java_rt_t *rt, const char *config,
    char *err, size_t err_size);
static int loom_java_register(JNIEnv *env, char *err, size_t err_size);
static void loom_java_describe(JNIEnv *env, const char *what, char *err,
    size_t err_size);


static const char *const  loom_java_config_keys[] = {
    "classpath", "xmx", "cpus", "jvm_options", "java_home", NULL
};

/* the worker's JVM and the options it was made with */
static JavaVM           *loom_java_vm;
static char             *loom_java_vm_key;

/* it started, but without loom.offload.Native: every load fails */
static int               loom_java_vm_unusable;
static pthread_mutex_t   loom_java_vm_lock = PTHREAD_MUTEX_INITIALIZER;

/* where the JVM's own messages go while it starts */
static loom_java_rt_t   *loom_java_starting;


static jint JNICALL
loom_java_vfprintf(FILE *fp, const char *fmt, va_list args)
{
    int   n;
    char  buf[2048];

    n = vsnprintf(buf, sizeof(buf), fmt, args);
    if (n <= 0) {
        return n;
    }

    if ((size_t) n >= sizeof(buf)) {
        n = sizeof(buf) - 1;
    }

    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' ')) {
        n--;
    }

    if (n == 0) {
        return 0;
    }

    if (loom_java_starting != NULL) {
        loom_java_starting->host->log(loom_java_starting->queue,
                                      LOOM_OFFLOAD_LOG_ERR, buf, n);

    } else {
        fprintf(stderr, "loom java: %.*s\n", n, buf);
    }

    return n;
}





/* ---- native methods of loom.offload.Native ---- */


/*
 * The name of the last task a thread took, whose String Java keeps in
 * names[0]: the next task for the same handler (the usual case) reuses it,
 * saving an allocation and the handler map's hashing of a new String.
 */
static __thread char    loom_java_last_name[LOOM_JAVA_NAME_CACHE];
static __thread size_t  loom_java_last_size;    /* its length + 1, 0: none */


static void
loom_java_reply(JNIEnv *env, loom_java_rt_t *rt, loom_offload_task_t *task,
    jint status, jbyteArray data)
{
    jsize   len;
    jbyte  *bytes;

    if (data == NULL) {
        rt->host->answer(task, status, NULL, 0);
        return;
    }

    /* no copy: the host copies the bytes before answer() returns */
    len = (*env)->GetArrayLength(env, data);
    bytes = (*env)->GetPrimitiveArrayCritical(env, data, NULL);

    if (bytes == NULL) {
        static const char  msg[] = "no memory for the answer";

        (*env)->ExceptionClear(env);
        rt->host->answer(task, LOOM_OFFLOAD_ERROR, msg, sizeof(msg) - 1);
        return;
    }

    rt->host->answer(task, status, bytes, (size_t) len);
    (*env)->ReleasePrimitiveArrayCritical(env, data, bytes, JNI_ABORT);
}


/*
 * A thread's one crossing per task: answers the task slot[1] holds, if
 * any, with out; takes the next task into slot[1] (0 when none came in
 * time, -1 when the queue is closed); and returns its data (the request
 * bytes after the handler's name and its NUL byte) with the name in
 * names[0], each in one copy. The task is in slot[1] before anything is
 * allocated, so that Java can answer it when an allocation throws.
 */
static jbyteArray JNICALL
loom_java_next(JNIEnv *env, jclass cls, jlong rtp, jlongArray slot,
    jbyteArray out, jobjectArray names, jint timeout_ms)
{
    int                   rc;
    jlong                 held;
    size_t                len, name_len;
    jstring               name;
    jbyteArray            arr;
    loom_java_rt_t       *rt;
    loom_offload_task_t  *task;
    const unsigned char  *req, *nul;

    rt = (loom_java_rt_t *) (intptr_t) rtp;

    (*env)->GetLongArrayRegion(env, slot, 1, 1, &held);

    if (held != 0 && held != -1) {
        loom_java_reply(env, rt, (loom_offload_task_t *) (intptr_t) held,
                        LOOM_OFFLOAD_OK, out);
    }

    rc = rt->host->wait(rt->queue, timeout_ms, &task);

    held = rc == LOOM_OFFLOAD_TASK ? (jlong) (intptr_t) task
           : rc == LOOM_OFFLOAD_CLOSED ? -1 : 0;

    (*env)->SetLongArrayRegion(env, slot, 1, 1, &held);

    if (rc != LOOM_OFFLOAD_TASK) {
        return NULL;
    }

    req = rt->host->request(task, &len);

    /* the request is NUL-terminated: a name without data ends there */
    nul = memchr(req, '\0', len + 1);
    name_len = nul - req;

    if (name_len + 1 != loom_java_last_size
        || memcmp(req, loom_java_last_name, name_len) != 0)
    {
        /* no name in the log if the new one cannot be made */
        loom_java_last_size = 0;
        (*env)->SetObjectArrayElement(env, names, 0, NULL);

        name = (*env)->NewStringUTF(env, (const char *) req);
        if (name == NULL) {
            return NULL;    /* OutOfMemoryError pending */
        }

        (*env)->SetObjectArrayElement(env, names, 0, name);
        (*env)->DeleteLocalRef(env, name);

        if (name_len < LOOM_JAVA_NAME_CACHE) {
            memcpy(loom_java_last_name, req, name_len);
            loom_java_last_size = name_len + 1;
        }
    }

    len = name_len < len ? len - name_len - 1 : 0;

    arr = (*env)->NewByteArray(env, (jsize) len);
    if (arr == NULL) {
        return NULL;
    }

    (*env)->SetByteArrayRegion(env, arr, 0, (jsize) len,
                               (const jbyte *) nul + 1);
    return arr;
}


static jboolean JNICALL
loom_java_cancelled(JNIEnv *env, jclass cls, jlong rtp, jlong taskp)
{
    loom_java_rt_t  *rt;

    rt = (loom_java_rt_t *) (intptr_t) rtp;

    return rt->host->cancelled((loom_offload_task_t *) (intptr_t) taskp)
           ? JNI_TRUE : JNI_FALSE;
}


static void JNICALL
loom_java_answer(JNIEnv *env, jclass cls, jlong rtp, jlong taskp,
    jint status, jbyteArray data)
{
    loom_java_reply(env, (loom_java_rt_t *) (intptr_t) rtp,
                    (loom_offload_task_t *) (intptr_t) taskp, status, data);
}


static void JNICALL
loom_java_log(JNIEnv *env, jclass cls, jlong rtp, jint level, jstring msg)
{
    const char      *s;
    loom_java_rt_t  *rt;

    rt = (loom_java_rt_t *) (intptr_t) rtp;

    s = (*env)->GetStringUTFChars(env, msg, NULL);
    if (s == NULL) {
        (*env)->ExceptionClear(env);
        return;
    }

    rt->host->log(rt->queue, level, s, strlen(s));
    (*env)->ReleaseStringUTFChars(env, msg, s);
}


static void JNICALL
loom_java_exited(JNIEnv *env, jclass cls, jlong rtp)
{
    loom_java_rt_t  *rt;

    rt = (loom_java_rt_t *) (intptr_t) rtp;

    pthread_mutex_lock(&rt->lock);
    rt->live--;
    pthread_cond_broadcast(&rt->cond);
    pthread_mutex_unlock(&rt->lock);
}


static JNINativeMethod  loom_java_natives[] = {
    { "next", "(J[J[B[Ljava/lang/String;I)[B", (void *) loom_java_next },
    { "cancelled", "(JJ)Z", (void *) loom_java_cancelled },
    { "answer", "(JJI[B)V", (void *) loom_java_answer },
    { "log", "(JILjava/lang/String;)V", (void *) loom_java_log },
    { "exited", "(J)V", (void *) loom_java_exited },
};


static int
loom_java_register(JNIEnv *env, char *err, size_t err_size)
{
    jclass  cls;

    cls = (*env)->FindClass(env, "loom/offload/Native");
    if (cls == NULL) {
        loom_java_describe(env, "failed to find loom.offload.Native", err,
                           err_size);
        return -1;
    }

    if ((*env)->RegisterNatives(env, cls, loom_java_natives,
                                sizeof(loom_java_natives)
                                / sizeof(loom_java_natives[0]))
        != 0)
    {
        loom_java_describe(env, "failed to register natives", err,
                           err_size);
        return -1;
    }

    (*env)->DeleteLocalRef(env, cls);
    return 0;
}


/* "what: <exception class>: <message>", and clears the exception */
static void
loom_java_describe(JNIEnv *env, const char *what, char *err,
    size_t err_size)
{
    jclass       cls;
    jstring      str;
    jmethodID    to_string;
    jthrowable   exc;
    const char  *s;

    exc = (*env)->ExceptionOccurred(env);
    if (exc == NULL) {
        snprintf(err, err_size, "%s", what);
        return;
    }

    (*env)->ExceptionClear(env);

    cls = (*env)->GetObjectClass(env, exc);
    to_string = (*env)->GetMethodID(env, cls, "toString",
                                    "()Ljava/lang/String;");
    str = to_string == NULL ? NULL
          : (*env)->CallObjectMethod(env, exc, to_string);
    s = str == NULL ? NULL : (*env)->GetStringUTFChars(env, str, NULL);

    snprintf(err, err_size, "%s: %s", what, s != NULL ? s : "(unknown)");

    if (s != NULL) {
        (*env)->ReleaseStringUTFChars(env, str, s);
    }

    (*env)->ExceptionClear(env);
}


/* ---- the JVM ---- */


/*
 * The crash-loop guard: a file lists the workers (pids) that started a
 * JVM under this master with these options and did not come back from
 * it. One whose process is gone was exited by the JVM while starting, or
 * crashed; one still alive is starting now (the workers start their JVMs
 * at the same time) and counts for nothing. A start that returns takes
 * its pid out, and so does a worker that nginx exits while its JVM is
 * still starting (a reload or quit: that exit is made on the main
 * thread, the JVM's on the starting one). The file is named after the
 * master's pid and start time (a later master reusing the pid, as in a
 * restarted container, starts afresh), opened without following links,
 * used only when this user owns it, and changed under a lock.
 */

static char  loom_java_attempt_path[256];
static int   loom_java_creating;


static void
loom_java_attempt_name(const char *key)
{
    int                 fd;
    char                buf[1024], *p;
    pid_t               ppid;
    ssize_t             n;
    unsigned long       hash;
    unsigned long long  started;

    hash = 5381;
    for (p = (char *) key; *p; p++) {
        hash = hash * 33 + (unsigned char) *p;
    }

    ppid = getppid();
    started = 0;

    snprintf(buf, sizeof(buf), "/proc/%ld/stat", (long) ppid);
    fd = open(buf, O_RDONLY | O_CLOEXEC);

    if (fd != -1) {
        n = read(fd, buf, sizeof(buf) - 1);
        close(fd);
        buf[n > 0 ? n : 0] = '\0';

        /* starttime is field 22; the name (field 2) may hold spaces */
        p = strrchr(buf, ')');

        if (p != NULL) {
            (void) sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u "
                          "%*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
                          &started);
        }
    }

    snprintf(loom_java_attempt_path, sizeof(loom_java_attempt_path),
             "/tmp/loom-jvm-start-%ld-%llu-%lx", (long) ppid, started, hash);
}


/*
 * Adds this process to the file (op 1: returns the number of processes
 * listed that are gone, or -1 when the file cannot be used; when that
 * number reaches LOOM_JAVA_MAX_ATTEMPTS this process is not added), or
 * takes it out (op 0), with the gone ones too (op -1: the JVM started).
 */
static int
loom_java_attempt(int op)
{
    int          fd, gone, keep;
    char         buf[4096], out[4096], *p, *end;
    long         pid, self;
    size_t       len;
    ssize_t      n;
    struct stat  st;

    fd = open(loom_java_attempt_path,
              O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd == -1) {
        return -1;
    }

    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)
        || st.st_uid != geteuid() || flock(fd, LOCK_EX) != 0)
    {
        close(fd);
        return -1;
    }

    n = pread(fd, buf, sizeof(buf) - 1, 0);
    buf[n > 0 ? n : 0] = '\0';

    self = (long) getpid();
    gone = 0;
    len = 0;

    for (p = buf; *p; p = end) {
        pid = strtol(p, &end, 10);

        if (end == p) {
            break;
        }

        if (pid <= 0 || pid == self) {
            continue;
        }

        keep = kill((pid_t) pid, 0) == 0 || errno != ESRCH;

        if (!keep) {
            gone++;

            if (op == -1) {
                continue;
            }
        }

        if (len + 24 < sizeof(out)) {
            len += snprintf(out + len, sizeof(out) - len, "%ld\n", pid);
        }
    }

    if (op == 1 && gone < LOOM_JAVA_MAX_ATTEMPTS) {
        len += snprintf(out + len, sizeof(out) - len, "%ld\n", self);
    }

    if (len == 0) {
        (void) unlink(loom_java_attempt_path);

    } else if (ftruncate(fd, 0) != 0
               || pwrite(fd, out, len, 0) != (ssize_t) len)
    {
        gone = -1;
    }

    close(fd);
    return gone;
}


/* at exit: a worker nginx exits during the start is no JVM failure */
static void
loom_java_atexit(void)
{
    if (__atomic_load_n(&loom_java_creating, __ATOMIC_ACQUIRE)
        && (pid_t) syscall(SYS_gettid) == getpid())
    {
        (void) loom_java_attempt(0);
    }
}


static int
loom_java_start_vm(loom_java_rt_t *rt, const char *config, char *err,
    size_t err_size)
{
    int                  nopt, rc, tries;
    char                *xmx, *cpus, *extra, *home, *key, *o, *save, *dir;
    char                 jar[4096], lib[4096], opt_xmx[64], opt_cpus[64];
    char                 opt_cp[4200];
    void                *jvm_lib, *env;
    Dl_info              info;
    JavaVMOption         options[LOOM_JAVA_MAX_OPTIONS];
    JavaVMInitArgs       args;
    loom_java_create_pt  create;

    xmx = loom_rt_config_get(config, "xmx");
    cpus = loom_rt_config_get(config, "cpus");
    extra = loom_rt_config_get(config, "jvm_options");
    home = loom_rt_config_get(config, "java_home");

    rc = -1;
    key = NULL;

    if (asprintf(&key, "xmx=%s cpus=%s jvm_options=%s java_home=%s",
                 xmx ? xmx : "64m", cpus ? cpus : "1", extra ? extra : "",
                 home ? home : LOOM_JAVA_HOME) == -1)
    {
        key = NULL;
        snprintf(err, err_size, "no memory");
        goto done;
    }

    if (loom_java_vm != NULL) {
        if (loom_java_vm_unusable) {
            snprintf(err, err_size, "this worker's JVM started without "
                     "loom.offload.Native (see the first load's error), "
                     "and a process cannot make another");
            goto done;
        }

        if (strcmp(key, loom_java_vm_key) != 0) {
            snprintf(err, err_size, "this worker's JVM was started with "
                     "\"%s\", not \"%s\" (one JVM per process)",
                     loom_java_vm_key, key);
            goto done;
        }

        rc = 0;
        goto done;
    }

    /* the jar sits next to this library */
    if (dladdr((void *) loom_offload_init, &info) == 0
        || info.dli_fname == NULL)
    {
        snprintf(err, err_size, "failed to find the runtime's directory");
        goto done;
    }

    snprintf(lib, sizeof(lib), "%s", info.dli_fname);
    dir = dirname(lib);
    snprintf(jar, sizeof(jar), "%s/%s", dir, LOOM_JAVA_JAR);

    if (access(jar, R_OK) != 0) {
        snprintf(err, err_size, "failed to read %s: %s", jar,
                 strerror(errno));
        goto done;
    }

    nopt = 0;
    snprintf(opt_cp, sizeof(opt_cp), "-Djava.class.path=%s", jar);
    options[nopt++].optionString = opt_cp;
    /* nginx keeps HUP, QUIT, TERM, INT and USR1 */
    options[nopt++].optionString = "-Xrs";
    snprintf(opt_xmx, sizeof(opt_xmx), "-Xmx%s", xmx ? xmx : "64m");
    options[nopt++].optionString = opt_xmx;
    snprintf(opt_cpus, sizeof(opt_cpus), "-XX:ActiveProcessorCount=%s",
             cpus ? cpus : "1");
    options[nopt++].optionString = opt_cpus;
    options[nopt].optionString = "vfprintf";
    options[nopt++].extraInfo = (void *) loom_java_vfprintf;

    if (extra != NULL) {
        for (o = strtok_r(extra, ",", &save); o != NULL;
             o = strtok_r(NULL, ",", &save))
        {
            if (nopt == LOOM_JAVA_MAX_OPTIONS) {
                snprintf(err, err_size, "more than %d jvm_options",
                         LOOM_JAVA_MAX_OPTIONS - 5);
                goto done;
            }

            options[nopt++].optionString = o;
        }
    }

    snprintf(lib, sizeof(lib), "%s/lib/server/libjvm.so",
             home ? home : LOOM_JAVA_HOME);

    jvm_lib = dlopen(lib, RTLD_NOW | RTLD_GLOBAL);
    if (jvm_lib == NULL) {
        snprintf(err, err_size, "failed to load the JVM: %s", dlerror());
        goto done;
    }

    create = (loom_java_create_pt) dlsym(jvm_lib, "JNI_CreateJavaVM");
    if (create == NULL) {
        snprintf(err, err_size, "failed to find JNI_CreateJavaVM in %s",
                 lib);
        goto done;
    }

    if (loom_java_attempt_path[0] == '\0') {
        (void) atexit(loom_java_atexit);
    }

    loom_java_attempt_name(key);

    tries = loom_java_attempt(1);
    if (tries >= LOOM_JAVA_MAX_ATTEMPTS) {
        snprintf(err, err_size, "the JVM exited the worker %d times while "
                 "starting with \"%s\" (see its messages above): not "
                 "tried again under this master; fix the options and "
                 "reload", tries, key);
        goto done;
    }

    args.version = JNI_VERSION_10;
    args.nOptions = nopt;
    args.options = options;
    args.ignoreUnrecognized = JNI_FALSE;

    loom_java_starting = rt;
    __atomic_store_n(&loom_java_creating, 1, __ATOMIC_RELEASE);

    rc = create(&loom_java_vm, &env, &args);

    __atomic_store_n(&loom_java_creating, 0, __ATOMIC_RELEASE);
    loom_java_starting = NULL;

    /* it came back, whatever it says: the options do not exit workers */
    (void) loom_java_attempt(-1);

    if (rc != JNI_OK) {
        loom_java_vm = NULL;
        snprintf(err, err_size, "failed to create the JVM (error %d) with "
                 "\"%s\"", rc, key);
        rc = -1;
        goto done;
    }

    if (loom_java_register(env, err, err_size) != 0) {
        /* the JVM stays: a process cannot make another */
        loom_java_vm_unusable = 1;
        rc = -1;
        goto done;
    }

    loom_java_vm_key = key;
    key = NULL;
    rc = 0;

done:

    free(xmx);
    free(cpus);
    free(extra);
    free(home);
    free(key);

    return rc;
}


int
loom_offload_init(loom_offload_init_t *init)
{
    int              rc;
    char            *classpath;
    jclass           cls;
    jobject          obj;
    JNIEnv          *env;
    jstring          jcp;
    jmethodID        ctor;
    loom_java_rt_t  *rt;

    if (init->abi_version < 1) {
        snprintf(init->err, init->err_size, "host ABI %u is too old",
                 init->abi_version);
        return 1;
    }

    if (loom_rt_config_check(init->config, loom_java_config_keys,
                             "classpath, xmx, cpus, jvm_options, java_home",
                             init->err, init->err_size)
        != 0)
    {
        return 1;
    }

    rt = calloc(1, sizeof(loom_java_rt_t));
    if (rt == NULL) {
        snprintf(init->err, init->err_size, "no memory");
        return 1;
    }

    rt->host = init->host;
    rt->queue = init->queue;
    rt->live = init->threads ? init->threads : 1;
    pthread_mutex_init(&rt->lock, NULL);
    pthread_cond_init(&rt->cond, NULL);

    pthread_mutex_lock(&loom_java_vm_lock);
    rc = loom_java_start_vm(rt, init->config, init->err, init->err_size);
    pthread_mutex_unlock(&loom_java_vm_lock);

    if (rc != 0) {
        free(rt);
        return 1;
    }

    if ((*loom_java_vm)->AttachCurrentThreadAsDaemon(loom_java_vm,
                                                     (void **) &env, NULL)
        != JNI_OK)
    {
        snprintf(init->err, init->err_size, "failed to attach to the JVM");
        free(rt);
        return 1;
    }

    classpath = loom_rt_config_get(init->config, "classpath");
    rc = 1;

    cls = (*env)->FindClass(env, "loom/offload/Runtime");
    ctor = cls == NULL ? NULL
           : (*env)->GetMethodID(env, cls, "<init>",
                                 "(JLjava/lang/String;I)V");
    jcp = ctor == NULL ? NULL
          : (*env)->NewStringUTF(env, classpath ? classpath : "");

    if (jcp == NULL) {
        loom_java_describe(env, "failed to find loom.offload.Runtime",
                           init->err, init->err_size);
        goto done;
    }

    obj = (*env)->NewObject(env, cls, ctor, (jlong) (intptr_t) rt, jcp,
                            (jint) rt->live);
    if (obj == NULL) {
        loom_java_describe(env, "failed to start the handlers' threads",
                           init->err, init->err_size);
        goto done;
    }

    rt->runtime = (*env)->NewGlobalRef(env, obj);
    init->instance = rt;
    rc = 0;

done:

    free(classpath);
    (*env)->ExceptionClear(env);
    (*loom_java_vm)->DetachCurrentThread(loom_java_vm);

    if (rc != 0) {
        free(rt);
    }

    return rc;
}


void
loom_offload_shutdown(void *instance)
{
    JNIEnv          *env;
    loom_java_rt_t  *rt;

    rt = instance;

    /* the queue is closed: every Java thread leaves after its call */
    pthread_mutex_lock(&rt->lock);
    while (rt->live > 0) {
        pthread_cond_wait(&rt->cond, &rt->lock);
    }
    pthread_mutex_unlock(&rt->lock);

    if ((*loom_java_vm)->AttachCurrentThreadAsDaemon(loom_java_vm,
                                                     (void **) &env, NULL)
        == JNI_OK)
    {
        (*env)->DeleteGlobalRef(env, rt->runtime);
        (*loom_java_vm)->DetachCurrentThread(loom_java_vm);
    }

    pthread_mutex_destroy(&rt->lock);
    pthread_cond_destroy(&rt->cond);
    free(rt);
}

/* vi:set ft=c ts=4 sw=4 et fdm=marker: */
