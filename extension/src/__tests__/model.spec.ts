import { diffSessions, sessionForNotebook, summarize } from '../model';
import { session } from './helpers';

describe('diffSessions', () => {
  it('finds added, removed, updated and unchanged sessions', () => {
    const a = session({ id: 'a' });
    const b = session({ id: 'b' });
    const c = session({ id: 'c' });
    const next = [
      { ...a, updated: 3000, age: 0.1 }, // only timestamps moved: unchanged
      { ...b, step: 13 },
      session({ id: 'd' })
    ];
    const diff = diffSessions([a, b, c], next);
    expect(diff.unchanged).toEqual(['a']);
    expect(diff.updated.map(s => s.id)).toEqual(['b']);
    expect(diff.added.map(s => s.id)).toEqual(['d']);
    expect(diff.removed).toEqual(['c']);
  });

  it('sees changes deep inside a session', () => {
    const a = session();
    const b = session({ memory: { ...a.memory, disk: { used_bytes: 1 } } });
    expect(diffSessions([a], [b]).updated).toHaveLength(1);
    const c = session({ last_command: { id: 'x', ok: true, time: 1 } });
    expect(diffSessions([a], [c]).updated).toHaveLength(1);
  });

  it('handles empty lists', () => {
    expect(diffSessions([], [])).toEqual({ added: [], updated: [], removed: [], unchanged: [] });
  });
});

describe('sessionForNotebook', () => {
  const x = session({ id: 'x', kernel_id: 'k1', notebook: 'a.ipynb', started: 1 });
  const y = session({ id: 'y', kernel_id: 'k1', notebook: 'a.ipynb', started: 5 });
  const z = session({ id: 'z', kernel_id: null, notebook: 'b.ipynb' });

  it('prefers the newest session in the notebook kernel', () => {
    expect(sessionForNotebook([x, y, z], 'k1', 'zzz.ipynb')?.id).toBe('y');
  });
  it('falls back to the notebook path', () => {
    expect(sessionForNotebook([x, y, z], 'k-other', 'b.ipynb')?.id).toBe('z');
    expect(sessionForNotebook([x, y, z], null, 'b.ipynb')?.id).toBe('z');
  });
  it('is null when nothing matches', () => {
    expect(sessionForNotebook([x, y, z], 'k9', 'c.ipynb')).toBeNull();
    expect(sessionForNotebook([], null, null)).toBeNull();
  });
});

describe('summarize', () => {
  it('counts by state', () => {
    const s = [session({ id: '1' }), session({ id: '2', state: 'paused' }), session({ id: '3' })];
    expect(summarize(s)).toEqual({ total: 3, running: 2, paused: 1 });
  });

  it('leaves out runs that ended', () => {
    const s = [session({ id: '1' }), session({ id: '2', state: 'finished', ended: 5 })];
    expect(summarize(s)).toEqual({ total: 1, running: 1, paused: 0 });
  });
});
