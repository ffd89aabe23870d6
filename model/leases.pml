/*
 * The lease protocol of django-leases, small enough for Spin to check every interleaving.
 *
 * One lease name, one lease store, one fenced resource, one revocation table. NCLIENTS clients
 * each try GRANTS acquisitions; an operator force-releases up to FORCES times; an intruder
 * that can read what inspect() shows (holder and token are public) tries to release, at any
 * moment, as often as it likes.
 *
 * Each atomic block below is ONE statement or script of the package, named in its comment:
 * the store and the resource are linearizable per statement (a PostgreSQL statement in
 * autocommit, a Redis Lua script), and nothing else is atomic. So whatever happens between
 * two such steps of a client -- a GC pause, SIGSTOP, a slow network -- is an interleaving,
 * and Spin explores all of them:
 *
 *   - time: TTLs are abstracted to a clock process that may expire the current grant at ANY
 *     moment (a pause of any length, a TTL of any length, renewals that come too late);
 *   - message delay: a client's request reaches the server whenever the interleaving says;
 *     a write or release whose reply timed out becomes a "stray" that the Wire process
 *     delivers at any later moment, while its sender goes on, or never (loss). One stray at
 *     a time, from client 0 (clients are symmetric, so it stands for any one client);
 *   - reply loss: an acquire whose reply is lost leaves an orphan grant nobody can use (the
 *     same as a client that crashes right after acquiring);
 *   - crashes: a client may drop its handle at any point (no release; the grant expires).
 *
 * Properties, as assertions in the step that changes the state they are about (with
 * -DSAFETY pan checks them in every reachable state, and reports deadlocks too):
 *   P1 at most one client's writes are accepted per token;
 *   P2 accepted tokens never decrease: once a write of token t is recorded, no write of a
 *      lower token (a superseded grant) is accepted;
 *   P3 once a grant's revocation is recorded (and in any case once the force release that
 *      evicted it returned), no write fenced by it is accepted;
 *   P4 a non-owner never releases (nor renews) a grant: ownership is holder + token + the
 *      grant's secret, and only the grantee knows the secret.
 *
 * Negative variants (model/verify runs each and requires a counterexample):
 *   -DNO_SECRET            renew/release compare holder and token only (the code before the
 *                          per-grant secret): the intruder releases with public data (P4);
 *   -DRELEASE_NO_TOKEN     release does not compare the token (with -DNO_SECRET: holder only);
 *   -DFENCE_ACCEPTS_LOWER  the fence admits a token one lower than the stored one (P2);
 *   -DFORCE_NO_REVOKE      force release records no revocation, only advances the token (P3);
 *   -DREVOKE_AFTER_FORCE   the revocation is recorded after the store's compare-and-revoke,
 *                          not before (P3);
 *   -DTAKEOVER_KEEPS_TOKEN taking over an expired grant does not bump the token (P1).
 * -DNO_INTRUDER leaves the intruder out; -DSHARED_HOLDER gives all clients one holder name.
 */

#ifndef NCLIENTS
#define NCLIENTS 3
#endif
#ifndef GRANTS
#define GRANTS 2
#endif
#ifndef FORCES
#define FORCES 1
#endif

/* Explicit holder names are shared by every grant of a client (holder="worker-1"), which is
 * the worst case for ownership: the default holder has a random per-grant part.
 * -DSHARED_HOLDER gives every client the same holder name. */
#ifdef SHARED_HOLDER
#define HOLDER(c) 1
#else
#define HOLDER(c) ((c) + 1)
#endif
/* The per-grant secret: unique per (client, grant), never 0 (the intruder's guess). */
#define SECRET(c, g) ((c) * GRANTS + (g))
#define NO_ONE 0

/* ---- The lease store: leases_lease's row of the name (database.py), or the name's :lock key
 * and :fence counter (redis.py). ---- */
byte holder;      /* '' (0) when released or force-released; kept (DB) after expiry */
byte token;       /* the name's counter: the last token handed out or revoked; 0 = never */
bool live;        /* DB: expires_at > clock_timestamp();  Redis: the :lock key exists */
byte secret;      /* the current grant's secret (DB: secret_hash). Also the ghost "owner"
                     of P4; with -DNO_SECRET the store does not compare it */

/* ---- leases_revocation's row of (backend, name): the revoked-through token ---- */
byte revoked;

/* ---- The resource: a FencedModel row's fencing_token, or leases_fence's row ---- */
byte fence;       /* the highest token accepted */
byte fence_by;    /* ghost: the client (c + 1) whose write set it, for P1 */

/* ---- Ghost: the highest token a completed force release evicted (for P3) ---- */
byte evicted;

/* ---- The network: a request whose reply timed out but which is still on its way, so it
 * reaches the server while its sender goes on. A paused client is already a delayed request;
 * this adds the one that outlives its sender's timeout. One at a time, from client STRAYER
 * only: clients are symmetric (they differ only in their names), so "client 0" stands for
 * any one client; the slot is reused, so client 0 can do this again and again. ---- */
#define STRAYER 0
mtype = { NONE, WRITE, RELEASE };
mtype stray = NONE;
byte stray_token;
byte stray_grant;    /* a release's grant: its secret is SECRET(STRAYER, stray_grant) */

#define MAX(a, b) ((a) > (b) -> (a) : (b))

#ifdef NO_SECRET
#define SECRET_OK(s) true
#else
#define SECRET_OK(s) (secret == (s))
#endif

#define OWNS(h, t, s) (holder == (h) && token == (t) && SECRET_OK(s))
#ifdef RELEASE_NO_TOKEN
#define RELEASE_OWNS(h, t, s) (holder == (h) && SECRET_OK(s))
#else
#define RELEASE_OWNS(h, t, s) OWNS(h, t, s)
#endif

#ifdef FENCE_ACCEPTS_LOWER
#define FENCE_ADMITS(t) (fence <= (t) + 1)
#else
#define FENCE_ADMITS(t) (fence <= (t))
#endif

/* ACQUIRE_SQL (leases/backends/database.py): insert, or take over a row whose holder is ''
 * or whose expires_at passed, with token = token + 1; nothing when held.
 * ACQUIRE_LUA (leases/backends/redis.py): BUSY if the :lock key exists, else counter + 1 and
 * SET NX PX. The grant's secret is chosen by the client and stored with it. */
inline acquire(c, g, t) {
  atomic {
    if
    :: holder == NO_ONE || !live ->
#ifdef TAKEOVER_KEEPS_TOKEN
       token = (holder != NO_ONE -> token : token + 1);
#else
       token++;
#endif
       holder = HOLDER(c); live = true; secret = SECRET(c, g); t = token;
       printf("client %d: ACQUIRE -> token %d\n", c, t)
    :: holder != NO_ONE && live -> t = 0
    fi
  }
}

/* RENEW_SQL (database.py): UPDATE ... WHERE name, holder, token (and the secret) match AND
 * expires_at > clock_timestamp(). RENEW_LUA (redis.py): GET == value, then PEXPIRE.
 * An expired grant is never revived; the clock may expire it again at any moment. */
#define RENEWS(c, t, s) (OWNS(HOLDER(c), t, s) && live)

/* RELEASE_SQL (database.py): UPDATE SET holder = '', expires_at = clock_timestamp() WHERE
 * name, holder, token (and the secret) match AND expires_at > clock_timestamp(); the row and
 * its token stay. RELEASE_LUA (redis.py): GET == value, then DEL (the :fence counter stays). */
inline release(h, t, s) {
  atomic {
    if
    :: RELEASE_OWNS(h, t, s) && live ->
       printf("  RELEASE holder %d token %d -> freed\n", h, t);
       assert(secret == s);  /* P4: only the grant's owner frees it */
       holder = NO_ONE; live = false
    :: !(RELEASE_OWNS(h, t, s) && live) ->  /* LeaseLost: others' grants stay */
       printf("  RELEASE holder %d token %d -> refused\n", h, t)
    fi
  }
}

/* The fenced write, one statement that decides and writes:
 * FencedModel.save(fence=lease) (leases/fencing/model.py, _do_update): UPDATE ... WHERE pk
 * AND fencing_token <= token AND NOT EXISTS (revocation) (NOT_REVOKED_SQL,
 * leases/revocation.py); check_fence's FENCE_SQL (leases/fencing/table.py) is the same
 * condition on leases_fence. Otherwise StaleFencingToken / FencingTokenRevoked. */
inline fenced_write(c, t) {
  atomic {
    if
    :: FENCE_ADMITS(t) && !(revoked >= t) ->
       printf("client %d: fenced write, token %d -> accepted\n", c, t);
       assert(t >= fence);                                      /* P2 */
       assert(t > evicted);                                     /* P3 */
       assert(t != fence || fence_by == NO_ONE || fence_by == (c) + 1);  /* P1 */
       fence = t; fence_by = (c) + 1
    :: !(FENCE_ADMITS(t) && !(revoked >= t)) ->
       printf("client %d: fenced write, token %d -> refused\n", c, t)
    fi
  }
}

/* REVOKE_SQL (leases/revocation.py, revocation.record): the revoked-through token only rises. */
inline record_revocation(seen) {
  atomic {
    revoked = MAX(revoked, seen);
    printf("operator: REVOKE through token %d\n", seen)
  }
}

/* FORCE_RELEASE_SQL (database.py) / FORCE_RELEASE_LUA (redis.py): compare-and-revoke. Only
 * while the stored token is still the one the operator saw: token + 1, free the name. */
inline compare_and_revoke(seen) {
  atomic {
    if
    :: token == seen ->
       token++; holder = NO_ONE; live = false; evicted = MAX(evicted, seen);
       printf("operator: FORCE_RELEASE token %d -> revoked\n", seen)
    :: token != seen ->       /* LeaseNotHeld: it changed hands since the operator looked */
       printf("operator: FORCE_RELEASE token %d -> refused\n", seen)
    fi
  }
}

/* A client: a process with one explicit holder name that takes GRANTS leases one after
 * another. While it believes it holds one (Lease.ensure_held() passed: its belief may be
 * stale by any amount, since it can be paused right after), it writes, renews, releases,
 * times out, or crashes. */
proctype Client(byte c) {
  byte g = 0;   /* grants tried; the current grant's secret is SECRET(c, g) */
  byte t;       /* the token of the grant it believes it holds (0: none) */
  do
  :: g < GRANTS ->
     g++;
     acquire(c, g, t);
     if
     :: t == 0 -> skip                 /* LeaseUnavailable (timeout=0) */
     :: t != 0 ->
        do
        :: fenced_write(c, t)
        :: atomic {
             RENEWS(c, t, SECRET(c, g)) ->
             assert(secret == SECRET(c, g));  /* P4: only the grant's owner renews it */
             printf("client %d: RENEW token %d\n", c, t)
           }
        :: atomic { !RENEWS(c, t, SECRET(c, g)) }; break  /* LeaseLost: keepalive reports it */
        :: atomic { printf("client %d:\n", c); release(HOLDER(c), t, SECRET(c, g)) }; break
        :: atomic {                    /* a write whose reply timed out; the client goes on */
             c == STRAYER && stray == NONE -> stray = WRITE; stray_token = t;
             printf("client %d: fenced write, token %d, times out (still on its way)\n", c, t)
           }
        :: atomic {                    /* a release whose reply timed out: LeaseLost for it */
             c == STRAYER && stray == NONE -> stray = RELEASE; stray_token = t; stray_grant = g;
             printf("client %d: RELEASE token %d times out (still on its way)\n", c, t)
           };
           break
        :: break                       /* crashed, dropped the handle, or the acquire's reply
                                          was lost: nobody can renew the grant; it expires */
        od;
        t = 0
     fi
  :: else -> break
  od
}

#define CLEAR_STRAY stray = NONE; stray_token = 0; stray_grant = 0

/* The network: delivers the timed-out request at any later moment, or loses it. */
active proctype Wire() {
end:
  do
  :: atomic {
       stray == WRITE -> printf("network: delivers the late write\n");
       fenced_write(STRAYER, stray_token); CLEAR_STRAY
     }
  :: atomic {
       stray == RELEASE -> printf("network: delivers client %d's late release:\n", STRAYER);
       release(HOLDER(STRAYER), stray_token, SECRET(STRAYER, stray_grant));
       CLEAR_STRAY
     }
  :: atomic { stray != NONE -> printf("network: loses the late request\n"); CLEAR_STRAY }
  od
}

/* The server's clock: a held grant may expire at any moment (DB: expires_at passes on
 * clock_timestamp(); Redis: the :lock key's PX runs out). */
active proctype Clock() {
end:
  do
  :: atomic { holder != NO_ONE && live -> live = false; printf("clock: token %d expires\n", token) }
  od
}

/* leases.operations.force_release, in its order: compare the token seen (inspect()),
 * record the revocation, the backend's compare-and-revoke, then the audit record (no
 * protocol state). Each is its own statement: other steps interleave between them. */
active proctype Operator() {
  byte n = 0;
  byte seen;
  do
  :: n < FORCES ->
     n++;
     /* INSPECT_SQL / the inspect pipeline: the name is held with the token the page showed.
      * (The page may be older; only this comparison decides, so reading here is the same.) */
     atomic {
       if
       :: holder != NO_ONE && live -> seen = token; printf("operator: sees token %d held\n", seen)
       :: else -> seen = 0     /* LeaseNotHeld: nothing to release */
       fi
     }
     if
     :: seen != 0 ->
#if defined(FORCE_NO_REVOKE)
        compare_and_revoke(seen)
#elif defined(REVOKE_AFTER_FORCE)
        compare_and_revoke(seen);
        record_revocation(seen)
#else
        record_revocation(seen);
        compare_and_revoke(seen)
#endif
     :: else -> skip
     fi;
     seen = 0
  :: else -> break
  od
}

/* Anyone who can read inspect(), the admin or the logs: it knows the holder and the token,
 * builds a Grant by hand and releases it, at any moment and as often as it likes; it cannot
 * know the secret (its guess is 0). Reading and releasing are one step here: with an older
 * reading it could only do less. A refused try changes nothing, so it costs no states. */
#ifndef NO_INTRUDER
active proctype Intruder() {
end:
  do
  :: atomic { printf("intruder: with inspect()'s holder and token, no secret:\n");
               release(holder, token, 0) }
  od
}
#endif

init {
  byte c = 0;
  atomic {
    do
    :: c < NCLIENTS -> run Client(c); c++
    :: else -> break
    od
  }
}
