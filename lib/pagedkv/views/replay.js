/* The replay player: prev / next / play and a slider over a trace's frames.

   replay.py emits this script after the player's markup, with __REPLAY_ID__
   replaced by the player's DOM id. This header comment is not emitted; the
   code below is, byte for byte, so the committed notebooks that hold a replay
   stay identical. It is written compactly for that reason; read it as:

   r          the player's root element (the script does nothing without it)
   f          its frames (.pkv-frame), one per step; s the range input;
   c          the "k / n" step counter; p the play button; i the frame shown;
   t          the play timer (null when paused)
   show(k)    show frame k (clamped to 0..n-1) and only it; move the slider
              and the counter
   stop()     pause: clear the timer, relabel the button "play"
   prev/next  pause, then step one frame; the slider pauses and jumps
   play       from the last frame, restart at 0; then advance every 900 ms
              until the last frame

   The controls carry `hidden` in the markup and the script unhides them, so
   where no script runs (an untrusted notebook's sanitizer strips it) no dead
   button is left. Frames 1..n-1 are hidden by a <style>, which that sanitizer
   strips too: there every frame shows, stacked in order.
*/
(function(){var r=document.getElementById('__REPLAY_ID__');if(!r)return;
r.querySelector('.pkv-controls').hidden=false;var f=r.querySelectorAll('.pkv-frame'),s=r.querySelector('input'),c=r.querySelector('.pkv-step'),
p=r.querySelector('.pkv-play'),i=0,t=null;
function show(k){i=Math.max(0,Math.min(f.length-1,k));for(var j=0;j<f.length;j++)
f[j].style.display=j===i?'block':'none';s.value=i;c.textContent=(i+1)+' / '+f.length;}
function stop(){if(t){clearInterval(t);t=null;p.textContent='\u25b6 play';}}
r.querySelector('.pkv-prev').onclick=function(){stop();show(i-1);};
r.querySelector('.pkv-next').onclick=function(){stop();show(i+1);};
s.oninput=function(){stop();show(+s.value);};
p.onclick=function(){if(t){stop();return;}if(i>=f.length-1)show(0);p.textContent='\u275a\u275a pause';
t=setInterval(function(){if(i>=f.length-1){stop();return;}show(i+1);},900);};show(0);})();
