//! Leaving the group: the shutdown barrier every worker arrives at, then teardown (goodbyes,
//! sockets closed, threads joined); a worker that cannot reach the barrier tears down without it.

use super::*;

impl Inner {
    pub(super) fn shutdown(&self) -> Result<(), RpcError> {
        if self.shut.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let result = self.shutdown_barrier();
        self.teardown(result.is_ok());
        if result.is_ok() {
            self.leave();
        }
        result
    }

    /// Waits for this worker's calls, then for every worker to get here.
    pub(super) fn shutdown_barrier(&self) -> Result<(), RpcError> {
        let deadline = Instant::now() + self.opts.init_timeout;
        {
            let mut calls = lock(&self.calls);
            while !calls.map.is_empty() {
                // Every call ends by its own deadline; this bound is a backstop.
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    let p = calls.map.values().next().expect("not empty");
                    return Err(RpcError::Timeout {
                        worker: self.name_of(p.peer),
                        func: format!("shutdown waiting for {}", p.func),
                        timeout: self.opts.init_timeout,
                    });
                }
                calls = self
                    .drained_cv
                    .wait_timeout(calls, left.min(Duration::from_millis(100)))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        self.store.set(&format!("shutdown/{}", self.me), b"1")?;
        let keys: Vec<String> = (0..self.world()).map(|r| format!("shutdown/{r}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        loop {
            if let Some((r, why)) = self.dead_peer() {
                return Err(self.gone_error(r, "shutdown", &why));
            }
            if self.store.check(&keys)? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(RpcError::Timeout {
                    worker: "every worker".into(),
                    func: "shutdown".into(),
                    timeout: self.opts.init_timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Says goodbye (after everything queued before), waits for the peers'
    /// goodbyes when `graceful`, then stops every thread this agent joins.
    pub(super) fn teardown(&self, graceful: bool) {
        for (rank, p) in self.peers.iter().enumerate() {
            if p.is_some() {
                self.control(rank, Header::Goodbye);
            }
        }
        let _ = lock(&self.control).send(Control::Stop);
        if graceful {
            let deadline = Instant::now() + self.opts.timeout;
            let mut live = lock(&self.readers_live);
            while *live > 0 && Instant::now() < deadline {
                live = self
                    .readers_cv
                    .wait_timeout(live, Duration::from_millis(50))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        self.closing.store(true, Ordering::Release);
        // The control thread flushes the goodbyes before the sockets close.
        if let Some(t) = lock(&self.control_thread).take() {
            let _ = t.join();
        }
        let threads = std::mem::take(&mut *lock(&self.threads));
        for p in self.peers.iter().flatten() {
            let _ = p.stream.shutdown(Shutdown::Both);
        }
        {
            let mut calls = lock(&self.calls);
            calls.stop = true;
            self.reaper_cv.notify_all();
        }
        {
            let mut jobs = lock(&self.jobs);
            jobs.stop = true;
            jobs.queue.clear();
            self.jobs_cv.notify_all();
        }
        for t in threads {
            let _ = t.join();
        }
        // Whatever is still pending fails now rather than at its deadline.
        let ids: Vec<u64> = lock(&self.calls).map.keys().copied().collect();
        for id in ids {
            self.complete(id, |_| Err(self.shut_down_error()));
        }
        let owned = std::mem::take(&mut *self.owned());
        drop(owned);
    }

    /// Lets rank 0, which may host the store, know this worker is done with it.
    pub(super) fn leave(&self) {
        if self.store.add("left", 1).is_err() || self.me != 0 {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            match self.store.add("left", 0) {
                Ok(n) if n as usize >= self.world() => return,
                Ok(_) => std::thread::sleep(Duration::from_millis(2)),
                Err(_) => return,
            }
        }
    }
}
