//! Memory budgets: what the daemon keeps on behalf of clients (the output rings of running and
//! ended processes, queued stdin, replies kept for a resume, download queues) is bounded
//! daemon-wide (`--memory-budget-mb`) and per client (`memory_budget_bytes` in the clients
//! file, `--client-memory-budget-mb` for the single token).
//!
//! Every holder counts its bytes in a [`Held`]. Growing one past a budget first drops the
//! oldest kept data that may be dropped: the rings of ended processes, the one that ended
//! first first, then the oldest bytes of running processes' rings, oldest process first
//! (of the same client when the client's budget is what is full, of any client when the
//! daemon's is). A ring that lost bytes says so to its next reader (`process_output.dropped`).
//! What cannot be dropped (stdin a process has not read yet, replies owed to a client) is
//! refused past the budget with an error naming it, or held within a bound of its own
//! (a download's queue, an upload's) and counted all the same.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

/// What an open connection costs the daemon before it keeps anything: its task, its session,
/// the WebSocket's read buffer and (with replies sent in frames of 16 KiB) its write buffer,
/// its outbound queue. Counted from the handshake to the close, so that idle connections
/// alone cannot take the daemon past its budget; measured (39.4 KiB) with `executor-bench
/// --memory-sessions N --memory-processes 0` (bench/README.md).
pub const CONNECTION_BYTES: u64 = 48 * 1024;
/// What a process's entry in its session's table costs besides its output and its command
/// text (counted too): the entry, its ring's and exit's channels, its stdin budget, and the
/// allocator's page around a ring of 1 MiB. Counted until the entry is forgotten (8 ended
/// processes are kept per session); measured (8.7 KiB) with `executor-bench --memory-sessions
/// N --memory-budget-mb 4096`, against `--memory-processes 0`.
pub const RECORD_BYTES: u64 = 10 * 1024;

/// Kept data that can give bytes back: a process's output ring.
pub trait Evictable: Send + Sync {
    /// Drop up to `want` of the oldest bytes; returns how many were dropped (and released
    /// from the holder's [`Held`] without calling back into the budget).
    fn evict(&self, want: u64) -> u64;
}

/// The daemon's memory budget and what each client holds of it.
pub struct MemoryBudget {
    limit: u64,
    /// The budget of a client whose entry names none (the single token's, or the default
    /// of a clients file); `None`: only the daemon's bounds it.
    client_default: Option<u64>,
    state: Mutex<State>,
    gauges: Option<crate::metrics::MemoryGauges>,
}

#[derive(Default)]
struct State {
    used: u64,
    clients: HashMap<Arc<str>, u64>,
    /// Read buffers of connections that grew past their start, by the order they grew: the
    /// first to go (giving one back costs its client a resume, not data).
    buffers: BTreeMap<u64, Entry>,
    /// Rings of running processes, by registration order.
    running: BTreeMap<u64, Entry>,
    /// Rings of ended processes, by the order they ended.
    ended: BTreeMap<u64, Entry>,
    next_key: u64,
    /// Bytes dropped to stay within a budget, since the start.
    dropped: u64,
}

struct Entry {
    client: Arc<str>,
    ring: Weak<dyn Evictable>,
}

/// Whose budget a holder's bytes count against.
#[derive(Clone)]
pub struct Owner {
    budget: Arc<MemoryBudget>,
    client: Arc<str>,
    /// The client's own budget (`None`: only the daemon's).
    limit: Option<u64>,
    /// Where output is counted against the client's `output_quota_bytes` as it arrives.
    usage: Option<Arc<crate::clients::Usage>>,
}

/// Bytes a holder keeps, counted in the budget; released when dropped. Shared by the holder
/// and the budget (which drops a ring's bytes while that ring may be growing), so its count
/// is atomic and every method takes `&self`.
pub struct Held {
    owner: Owner,
    bytes: AtomicU64,
    /// The holder's key among the evictable rings (0: not one).
    key: AtomicU64,
}

impl MemoryBudget {
    pub fn new(
        limit: u64,
        client_default: Option<u64>,
        gauges: Option<crate::metrics::MemoryGauges>,
    ) -> Arc<Self> {
        if let Some(g) = &gauges {
            g.set_budget(limit);
        }
        Arc::new(Self {
            limit,
            client_default,
            state: Mutex::new(State::default()),
            gauges,
        })
    }

    /// The default daemon-wide budget: an eighth of the host's memory, at least 256 MiB and
    /// at most 8 GiB (256 MiB when the host's memory cannot be read).
    pub fn default_limit() -> u64 {
        const MIB: u64 = 1 << 20;
        let total = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|text| {
                text.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .map_or(0, |kib| kib * 1024);
        (total / 8).clamp(256 * MIB, 8192 * MIB)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Who holds bytes for `client`, whose entry names `limit` (else the default).
    pub fn owner(self: &Arc<Self>, client: &str, limit: Option<u64>) -> Owner {
        Owner {
            budget: self.clone(),
            client: Arc::from(client),
            limit: limit.or(self.client_default),
            usage: None,
        }
    }

    /// Bytes kept now, daemon-wide and for `client`.
    pub fn used(&self, client: &str) -> (u64, u64) {
        let state = self.lock();
        (state.used, state.clients.get(client).copied().unwrap_or(0))
    }

    /// Bytes dropped to stay within a budget since the start.
    #[cfg(test)]
    fn dropped(&self) -> u64 {
        self.lock().dropped
    }

    fn publish(&self, state: &State, client: &str) {
        if let Some(g) = &self.gauges {
            g.set_kept(state.used);
            g.set_client_kept(client, state.clients.get(client).copied().unwrap_or(0));
        }
    }

    /// Reserve up to `want` bytes for `owner`, dropping older kept data to make room (never
    /// `exclude`'s own). Returns what was granted: `want` when it fits (or `force`), less
    /// when the budget is full of what cannot be dropped.
    fn reserve(&self, owner: &Owner, want: u64, exclude: Option<u64>, force: bool) -> u64 {
        if want == 0 {
            return 0;
        }
        // Rings made room from, kept alive until the lock is released: the last reference to
        // one (its process forgotten meanwhile) must not drop it, and with it its `Held`,
        // which takes this lock, under the lock (declared first, dropped last).
        let mut alive = Vec::new();
        let mut state = self.lock();
        let client_used = state.clients.get(&owner.client).copied().unwrap_or(0);
        let over_client = owner
            .limit
            .map_or(0, |limit| (client_used + want).saturating_sub(limit));
        if over_client > 0 {
            self.make_room(
                &mut state,
                Some(&owner.client),
                over_client,
                exclude,
                &mut alive,
            );
        }
        let over_all = (state.used + want).saturating_sub(self.limit);
        if over_all > 0 {
            self.make_room(&mut state, None, over_all, exclude, &mut alive);
        }
        let client_used = state.clients.get(&owner.client).copied().unwrap_or(0);
        let room_client = owner
            .limit
            .map_or(u64::MAX, |limit| limit.saturating_sub(client_used));
        let room_all = self.limit.saturating_sub(state.used);
        let granted = if force {
            want
        } else {
            want.min(room_client).min(room_all)
        };
        state.used += granted;
        *state.clients.entry(owner.client.clone()).or_default() += granted;
        self.publish(&state, &owner.client);
        granted
    }

    /// Drop kept data of `client` (or of anyone) until `need` bytes are free: connections'
    /// grown read buffers (the connection is closed for its client to resume), then ended
    /// rings, the first ended first, then running rings' oldest bytes, oldest ring first.
    fn make_room(
        &self,
        state: &mut State,
        client: Option<&Arc<str>>,
        need: u64,
        exclude: Option<u64>,
        alive: &mut Vec<Arc<dyn Evictable>>,
    ) {
        let mut freed = 0;
        for tier in 0..3 {
            // Walked in order without copying the tier (a daemon with thousands of idle
            // sessions has tens of thousands of ended rings), and what can never give bytes
            // again leaves it: a shed read buffer, an ended ring emptied, a ring gone.
            let mut from = 0;
            while freed < need {
                let map = match tier {
                    0 => &mut state.buffers,
                    1 => &mut state.ended,
                    _ => &mut state.running,
                };
                let Some((key, owner, ring)) = map
                    .range(from..)
                    .find(|(key, e)| {
                        Some(**key) != exclude && client.is_none_or(|c| *c == e.client)
                    })
                    .map(|(key, e)| (*key, e.client.clone(), e.ring.clone()))
                else {
                    break;
                };
                from = key + 1;
                let Some(ring) = ring.upgrade() else {
                    map.remove(&key);
                    continue;
                };
                let want = need - freed;
                let got = ring.evict(want);
                alive.push(ring);
                let spent = match tier {
                    0 => got > 0,
                    1 => got < want,
                    _ => false,
                };
                if spent {
                    map.remove(&key);
                }
                freed += got;
                state.used = state.used.saturating_sub(got);
                if let Some(used) = state.clients.get_mut(&owner) {
                    *used = used.saturating_sub(got);
                }
                state.dropped += got;
            }
            if freed >= need {
                break;
            }
        }
        if freed > 0 {
            tracing::debug!(
                freed,
                need,
                client = client.map(|c| &**c),
                "memory budget: dropped the oldest kept output"
            );
        }
    }

    fn release(&self, owner: &Owner, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut state = self.lock();
        state.used = state.used.saturating_sub(bytes);
        if let Some(used) = state.clients.get_mut(&owner.client) {
            *used = used.saturating_sub(bytes);
        }
        self.publish(&state, &owner.client);
    }
}

impl Owner {
    /// Which budget is full, for an error: the client's or the daemon's, with their use.
    pub fn describe(&self) -> String {
        let (all, mine) = self.budget.used(&self.client);
        match self.limit {
            Some(limit) if mine >= limit.saturating_sub(64 * 1024) => format!(
                "client {} keeps {mine} of its {limit} bytes (memory_budget_bytes)",
                self.client
            ),
            _ => format!(
                "the daemon keeps {all} of its {} bytes (--memory-budget-mb)",
                self.budget.limit
            ),
        }
    }

    /// Whether the client's or the daemon's budget is past its limit (what was forced in
    /// could not be made room for).
    pub fn over_budget(&self) -> bool {
        let (all, mine) = self.budget.used(&self.client);
        all > self.budget.limit || self.limit.is_some_and(|limit| mine > limit)
    }

    /// Count output against `usage` (the client's output quota) as it arrives.
    pub fn counting_output(mut self, usage: Arc<crate::clients::Usage>) -> Self {
        self.usage = Some(usage);
        self
    }

    /// `bytes` of output arrived (kept or not): they count against the output quota now, not
    /// when the process ends (which a server never does).
    pub fn output_arrived(&self, bytes: u64) {
        if let Some(usage) = &self.usage {
            usage.add_output(bytes);
        }
    }

    /// An empty holder.
    pub fn hold(&self) -> Held {
        Held {
            owner: self.clone(),
            bytes: AtomicU64::new(0),
            key: AtomicU64::new(0),
        }
    }

    /// A holder whose bytes may be dropped to make room for others (an output ring).
    pub fn hold_evictable(&self, ring: Weak<dyn Evictable>) -> Held {
        self.hold_in(ring, false)
    }

    /// A connection's read buffer past its start: given back (by closing the connection,
    /// whose session waits for a resume) before any output is dropped.
    pub fn hold_read_buffer(&self, connection: Weak<dyn Evictable>) -> Held {
        self.hold_in(connection, true)
    }

    fn hold_in(&self, ring: Weak<dyn Evictable>, buffer: bool) -> Held {
        let mut state = self.budget.lock();
        state.next_key += 1;
        let key = state.next_key;
        let tier = if buffer {
            &mut state.buffers
        } else {
            &mut state.running
        };
        tier.insert(
            key,
            Entry {
                client: self.client.clone(),
                ring,
            },
        );
        Held {
            owner: self.clone(),
            bytes: AtomicU64::new(0),
            key: AtomicU64::new(key),
        }
    }
}

impl Held {
    /// Bytes held now.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Acquire)
    }

    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// Whether the budget may take the holder's bytes back (see [`Evictable`]).
    pub fn is_evictable(&self) -> bool {
        self.key().is_some()
    }

    fn key(&self) -> Option<u64> {
        Some(self.key.load(Ordering::Acquire)).filter(|k| *k != 0)
    }

    /// Grow by up to `want` bytes within the budgets (dropping older kept data of others to
    /// make room); returns how many were granted.
    pub fn grow(&self, want: u64) -> u64 {
        let granted = self
            .owner
            .budget
            .reserve(&self.owner, want, self.key(), false);
        self.bytes.fetch_add(granted, Ordering::AcqRel);
        granted
    }

    /// Grow by exactly `want` bytes or not at all.
    pub fn try_grow(&self, want: u64) -> bool {
        let granted = self.grow(want);
        if granted < want {
            self.shrink(granted);
            return false;
        }
        true
    }

    /// Grow by `want` bytes whatever the budget says (what is bounded by a limit of its own),
    /// after dropping older kept data to make room for them.
    pub fn force(&self, want: u64) {
        let granted = self
            .owner
            .budget
            .reserve(&self.owner, want, self.key(), true);
        self.bytes.fetch_add(granted, Ordering::AcqRel);
    }

    pub fn shrink(&self, bytes: u64) {
        let taken = self.take(bytes);
        self.owner.budget.release(&self.owner, taken);
    }

    /// Take up to `bytes` off the count; returns how many.
    fn take(&self, bytes: u64) -> u64 {
        let mut taken = 0;
        let _ = self
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                taken = bytes.min(held);
                Some(held - taken)
            });
        taken
    }

    /// Bytes the budget dropped from the holder itself (see [`Evictable::evict`]): already
    /// released by the budget.
    pub fn evicted(&self, bytes: u64) {
        self.take(bytes);
    }

    /// The budget took everything the holder had (see [`Evictable::evict`]); returns how much.
    pub fn evicted_all(&self) -> u64 {
        self.take(u64::MAX)
    }

    /// The holder's data is complete (a process's output ended): it goes among the first to
    /// be dropped, after what ended before it.
    pub fn ended(&self) {
        let Some(key) = self.key() else {
            return;
        };
        let mut state = self.owner.budget.lock();
        if let Some(entry) = state.running.remove(&key) {
            state.next_key += 1;
            let new_key = state.next_key;
            state.ended.insert(new_key, entry);
            self.key.store(new_key, Ordering::Release);
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(key) = self.key() {
            let mut state = self.owner.budget.lock();
            state.running.remove(&key);
            state.ended.remove(&key);
            state.buffers.remove(&key);
        }
        let bytes = std::mem::take(self.bytes.get_mut());
        self.owner.budget.release(&self.owner, bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fake(Mutex<(u64, Option<Held>)>);

    impl Evictable for Fake {
        fn evict(&self, want: u64) -> u64 {
            let mut s = self.0.lock().unwrap();
            let n = want.min(s.0);
            s.0 -= n;
            if let Some(h) = &s.1 {
                h.evicted(n);
            }
            n
        }
    }

    fn ring(owner: &Owner, bytes: u64) -> Arc<Fake> {
        let fake = Arc::new(Fake(Mutex::new((0, None))));
        let weak: Weak<dyn Evictable> = Arc::downgrade(&(fake.clone() as Arc<dyn Evictable>));
        let held = owner.hold_evictable(weak);
        assert_eq!(held.grow(bytes), bytes);
        *fake.0.lock().unwrap() = (bytes, Some(held));
        fake
    }

    fn kept(f: &Fake) -> u64 {
        f.0.lock().unwrap().0
    }

    #[test]
    fn a_full_client_drops_its_own_oldest_ended_output_first_and_leaves_others_alone() {
        let budget = MemoryBudget::new(100, None, None);
        let a = budget.owner("a", Some(30));
        let b = budget.owner("b", None);
        let b1 = ring(&b, 40);
        let a1 = ring(&a, 10);
        let a2 = ring(&a, 10);
        a1.0.lock().unwrap().1.as_ref().unwrap().ended();
        a2.0.lock().unwrap().1.as_ref().unwrap().ended();
        let a3 = ring(&a, 10);
        // a is full (30 of 30): 15 more drop a1 (ended first) whole, then 5 of a2.
        let h = a3.0.lock().unwrap().1.take().unwrap();
        assert_eq!(h.grow(15), 15);
        assert_eq!((kept(&a1), kept(&a2), kept(&b1)), (0, 5, 40));
        assert_eq!(budget.used("a"), (70, 30));
        // Nothing of a's left to drop but a3 itself: the rest is refused.
        assert_eq!(h.grow(20), 5);
        assert_eq!(kept(&a2), 0);
        assert_eq!(budget.dropped(), 20);
        drop(h);
        assert_eq!(budget.used("a").1, 0);
    }

    /// A connection's read buffer: all or nothing, like the connection it is dropped with.
    struct Buffer(Mutex<Option<Held>>);

    impl Evictable for Buffer {
        fn evict(&self, _want: u64) -> u64 {
            self.0.lock().unwrap().as_ref().map_or(0, Held::evicted_all)
        }
    }

    #[test]
    fn grown_read_buffers_go_before_any_output_and_spent_entries_leave_the_walk() {
        let budget = MemoryBudget::new(100, None, None);
        let a = budget.owner("a", None);
        let ended = ring(&a, 30);
        ended.0.lock().unwrap().1.as_ref().unwrap().ended();
        let buffer = Arc::new(Buffer(Mutex::new(None)));
        let weak: Weak<dyn Evictable> = Arc::downgrade(&(buffer.clone() as Arc<dyn Evictable>));
        let held = a.hold_read_buffer(weak);
        held.force(40);
        *buffer.0.lock().unwrap() = Some(held);
        let other = a.hold();
        // 100 - 70 = 30 free: 20 more than that takes the buffer (40), not the output.
        assert!(other.try_grow(50));
        assert_eq!(kept(&ended), 30, "the ended output is intact");
        assert_eq!(budget.used("a").0, 80);
        // The buffer gave everything: it is out of the walk; the ended ring goes next, and
        // once empty leaves the walk too.
        assert!(!other.try_grow(60), "only 50 can be had");
        assert_eq!(kept(&ended), 0);
        {
            let state = budget.lock();
            assert!(state.buffers.is_empty(), "a shed buffer left the walk");
            assert!(
                state.ended.is_empty(),
                "an emptied ended ring left the walk"
            );
        }
        assert_eq!(budget.used("a").0, 50);
    }

    #[test]
    fn the_daemon_budget_drops_anyones_oldest_ended_output() {
        let budget = MemoryBudget::new(50, None, None);
        let a = budget.owner("a", None);
        let b = budget.owner("b", None);
        let a1 = ring(&a, 30);
        a1.0.lock().unwrap().1.as_ref().unwrap().ended();
        let hb = b.hold();
        assert!(hb.try_grow(40), "a's ended output makes room");
        assert_eq!(kept(&a1), 10);
        assert!(!hb.try_grow(40), "nothing droppable is left");
        assert_eq!((hb.bytes(), kept(&a1)), (40, 0));
        hb.force(15);
        assert_eq!(budget.used("b"), (55, 55));
    }
}
