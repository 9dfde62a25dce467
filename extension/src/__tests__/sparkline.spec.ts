import { sparkline } from '../sparkline';

function points(d: string): Array<[string, number, number]> {
  return Array.from(d.matchAll(/([ML])([\d.]+) ([\d.]+)/g)).map(m => [
    m[1],
    Number(m[2]),
    Number(m[3])
  ]);
}

describe('sparkline', () => {
  it('spans the box: first point left, last right, max at the top, min at the bottom', () => {
    const s = sparkline([4, 2, 3, 1], 100, 20, 0);
    const p = points(s.d);
    expect(p.map(x => x[0])).toEqual(['M', 'L', 'L', 'L']);
    expect(p[0]).toEqual(['M', 0, 0]); // 4 is the max: top
    expect(p[3]).toEqual(['L', 100, 20]); // 1 is the min: bottom
    expect(p[1][1]).toBeCloseTo(33.33, 1);
    expect(p[2][2]).toBeCloseTo(20 / 3, 1);
    expect([s.min, s.max]).toEqual([1, 4]);
    expect(s.last).toEqual([100, 20]);
  });

  it('respects the padding', () => {
    const p = points(sparkline([1, 2], 100, 20, 2).d);
    expect(p[0]).toEqual(['M', 2, 18]);
    expect(p[1]).toEqual(['L', 98, 2]);
  });

  it('breaks the line at missing values', () => {
    const p = points(sparkline([3, null, NaN, 2, 1], 40, 10, 0).d);
    expect(p.map(x => x[0])).toEqual(['M', 'M', 'L']);
    expect(p[1][1]).toBe(30);
  });

  it('draws a flat series through the middle', () => {
    const p = points(sparkline([2, 2, 2], 10, 10, 0).d);
    expect(p.every(x => x[2] === 5)).toBe(true);
  });

  it('draws a single value as a dot in the middle', () => {
    const s = sparkline([5], 10, 10, 0);
    expect(s.d).toBe('M5 5 h0.01');
  });

  it('draws nothing without data or room', () => {
    expect(sparkline([], 10, 10).d).toBe('');
    expect(sparkline([null, NaN], 10, 10).d).toBe('');
    expect(sparkline([1, 2], 2, 10, 1).d).toBe('');
  });
});
