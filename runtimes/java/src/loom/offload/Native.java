package loom.offload;

/** The host's functions, registered by libloom_rt_java.so. */
final class Native {

    static final int TIMEDOUT = 0;
    static final long CLOSED = -1;

    static final int OK = 0;
    static final int ERROR = 1;

    static final int LOG_ERR = 4;
    static final int LOG_WARN = 5;

    private Native() {
    }

    /** The next task, 0 when none came in time, CLOSED when closed. */
    static native long take(long rt, int timeoutMs);

    /** The data of a task; its handler's name goes to name[0]. */
    static native byte[] request(long rt, long task, String[] name);

    static native boolean cancelled(long rt, long task);

    static native void answer(long rt, long task, int status, byte[] data);

    static native void log(long rt, int level, String msg);

    /** Called by each worker thread as it leaves. */
    static native void exited(long rt);
}
